"""`kvprof serve-bench`: a trace's agents as real traffic on a vLLM server, under load, in two reuse patterns."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import Progress, TaskID

from kvprof.commands.common import console, demo_trace, note, progress, write_result
from kvprof.commands.options import OutOption, SeedOption
from kvprof.serving.bench import (
    CPU_KV_CACHE_GIB,
    ServerLaunch,
    check_options,
    prepare_server,
    serve_bench_result,
    server_failure,
    server_launch,
)
from kvprof.serving.client import ServerClient, ServerError
from kvprof.serving.driver import LoadRun, RequestRecord, run_load
from kvprof.serving.server import VllmServer
from kvprof.serving.traffic import PATTERNS, Load, ServedModels, loads, trajectory_traffic
from kvprof.traces.trace import Trajectory, iter_trajectories, trace_header

if TYPE_CHECKING:
    from kvprof.results.serve_bench import ServeBenchResult

DEFAULT_VLLM_PYTHON = Path(".venv-vllm/bin/python")
HELP = {
    "url": "A running vLLM OpenAI-compatible server (http://HOST:PORT) to drive.",
    "trace": "Trace (JSONL) from `kvprof capture`; without one, the demo world's short lora-mode trace.",
    "start": "Start a vLLM server on 127.0.0.1 for the trace's model and adapters (multi-LoRA, prefix caching), and "
    "stop it at the end.",
    "pattern": "Reuse pattern, repeatable: agents (each turn on its agent's adapter: today's deployment) or base "
    "(every turn on the base model: caches shared across agents, FullShared's pattern).",
    "qps": "Open loop: trajectories arrive as a Poisson process at this rate; repeatable.",
    "concurrency": "Closed loop: this many trajectories in flight; repeatable (without --qps: 1 and 4).",
    "served_base": "The base model's name on the server (by default the one model it serves that is not an adapter).",
    "dtype": "With --start: the dtype vLLM runs in: auto (the dtype the trace was captured in, so greedy outputs can "
    "agree), float32, bfloat16 or float16.",
    "kv_cache_gib": "With --start: KV-cache memory in GiB (by default vLLM's own choice on a GPU, "
    f"{CPU_KV_CACHE_GIB:g} GiB on a machine without one).",
}


def command(
    trace: Annotated[Path | None, typer.Argument(help=HELP["trace"])] = None,
    url: Annotated[str | None, typer.Option("--url", help=HELP["url"])] = None,
    start: Annotated[bool, typer.Option("--start", help=HELP["start"])] = False,
    vllm_python: Annotated[
        Path, typer.Option("--vllm-python", help="With --start: the python of an environment with vLLM installed.")
    ] = DEFAULT_VLLM_PYTHON,
    pattern: Annotated[list[str], typer.Option("--pattern", help=HELP["pattern"])] = list(PATTERNS),
    qps: Annotated[list[float] | None, typer.Option("--qps", help=HELP["qps"])] = None,
    concurrency: Annotated[list[int] | None, typer.Option("--concurrency", help=HELP["concurrency"])] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Use only the first N trajectories.")] = None,
    max_seconds: Annotated[
        float, typer.Option("--max-seconds", min=1, help="Per run: send no new turn after this many seconds.")
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
    served_base: Annotated[str | None, typer.Option("--served-base", help=HELP["served_base"])] = None,
    dtype: Annotated[str, typer.Option("--dtype", help=HELP["dtype"])] = "auto",
    kv_cache_gib: Annotated[float | None, typer.Option("--kv-cache-gib", help=HELP["kv_cache_gib"])] = None,
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
    check_options(trace, header, pattern, url, start)
    sweep = loads(qps or [], concurrency or ([] if qps else [1, 4]))
    trajectories = list(iter_trajectories(trace))[:limit]
    launch = None
    if start:
        launch = server_launch(header, trace, model, vllm_python, dtype, kv_cache_gib, list(vllm_arg or []), out)
    with _server(url, launch, startup_timeout) as (address, server):
        client = ServerClient(address, timeout=request_timeout)
        described = {"url": address, "started": server is not None, "pid": server.pid if server else None}
        try:
            engine = client.version()
            served = prepare_server(
                client, header, trace, trajectories, pattern, served_base, len(pattern) * len(sweep), note
            )
            runs = _run_loads(client, trajectories, pattern, served, sweep, seed, max_seconds)
        except ServerError as err:
            raise server_failure(server, err) from None
    description = described | {"version": engine, "command": server.command if server else None}
    description = {key: description[key] for key in ("url", "version", "started", "pid", "command")}
    result = serve_bench_result(trace, header, description, served, trajectories, runs)
    show(result)
    path = write_result(out, "serve_bench", result.to_json(), args)
    console.print(f"wrote {path} (dashboard: kvprof report {path})")


@contextlib.contextmanager
def _server(
    url: str | None, launch: ServerLaunch | None, startup_timeout: float
) -> Iterator[tuple[str, VllmServer | None]]:
    """(address, None) for the user's server at `url`; else the vLLM server `launch` starts, stopped on exit."""
    if launch is None:
        assert url is not None
        yield url, None
        return
    console.print(
        f"starting vLLM on 127.0.0.1:{launch.port} ({launch.dtype}, {len(launch.adapters)} adapters); log: {launch.log}"
    )
    began = time.monotonic()
    with launch.start(startup_timeout) as server:
        console.print(f"vLLM server (pid {server.pid}) up after {time.monotonic() - began:.0f} s")
        yield server.url, server


def _run_loads(
    client: ServerClient,
    trajectories: list[Trajectory],
    patterns: list[str],
    served: ServedModels,
    sweep: list[Load],
    seed: int,
    max_seconds: float,
) -> list[LoadRun]:
    """Each pattern at each load, under a progress bar, the prefix cache emptied before every run but the first."""
    runs: list[LoadRun] = []
    with progress() as bar:
        for name in patterns:
            traffic = trajectory_traffic(trajectories, name, served)
            for index, load in enumerate(sweep):
                if runs:
                    client.reset_prefix_cache()
                job = bar.add_task(f"{name} @ {load.label}", total=sum(len(t.turns) for t in traffic))
                on_request = functools.partial(_advance, bar, job)
                run = run_load(client, traffic, name, load, seed + index, max_seconds, on_request=on_request)
                if run.unfinished:
                    bar.console.print(
                        f"[yellow]{name} @ {load.label}: --max-seconds {max_seconds:g} cut {len(run.unfinished)} "
                        "trajectories short[/]"
                    )
                runs.append(run)
    return runs


def _advance(bar: Progress, job: TaskID, record: RequestRecord) -> None:
    """Count one answered request on the run's progress bar."""
    bar.advance(job)


def show(result: ServeBenchResult) -> None:
    """The run table, the per-agent table and the pattern comparison."""
    from kvprof.report.serve_bench import agents_table, comparison_table, runs_table

    console.print(runs_table(result).to_rich())
    console.print(agents_table(result).to_rich())
    comparison = comparison_table(result)
    if comparison is not None:
        console.print(comparison.to_rich())
