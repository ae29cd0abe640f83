"""A vLLM OpenAI-compatible server kvprof starts for a trace and always stops.

Run from vLLM's own environment (`--vllm-python`) as `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1,
with multi-LoRA, prefix caching, prompt-token details and per-request timings. `stop()` ends its process group on
every exit path (Ctrl-C too); PR_SET_PDEATHSIG kills it should kvprof be killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.fileio import is_json, read_json_file
from kvprof.serving.client import ServerClient

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 10.0
EXCEPTION_MESSAGE = re.compile(r"\b[A-Za-z_]*(?:Error|Exception): ")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: receive SIGTERM when the process that started it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def server_command(
    python: str,
    model: str,
    adapters: dict[str, str],
    dtype: str,
    port: int,
    kv_cache_bytes: int | None,
    extra: list[str],
) -> list[str]:
    """vLLM's command line; `adapters`: served name → folder; `extra` last (may override anything)."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--dtype", dtype, "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    command += ["--enable-per-request-metrics", "--enforce-eager", "--uvicorn-log-level", "warning"]
    if adapters:
        ranks = [adapter_rank(path) for path in adapters.values()]
        command += ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(lora_rank_slot(ranks))]
        command += ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
    if kv_cache_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    return command + extra


def adapter_rank(path: str) -> int:
    """The LoRA rank `r` in a PEFT adapter folder's adapter_config.json (its largest, with a rank pattern)."""
    config_path = Path(path) / "adapter_config.json"
    fix = "pass a PEFT LoRA adapter folder"
    config = read_json_file(config_path, "adapter config", fix)
    if not isinstance(config, dict) or not isinstance(config.get("rank_pattern") or {}, dict):
        raise KvprofError(f"{config_path} is not a PEFT adapter config; {fix}.")
    ranks = [8 if config.get("r") is None else config["r"], *(config.get("rank_pattern") or {}).values()]
    if not all(is_json(rank, int) for rank in ranks):
        raise KvprofError(f"{config_path} has LoRA ranks that are not integers; {fix}.")
    return max(ranks)


def lora_rank_slot(ranks: list[int]) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds every adapter's rank."""
    slots = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    largest = max(ranks)
    for slot in slots:
        if slot >= largest:
            return slot
    raise KvprofError(f"an adapter has rank {largest}, above the {slots[-1]} vLLM serves; use adapters of lower rank.")


class VllmServer:
    """`with VllmServer(command, port, log, startup_timeout) as server:` starts it, waits for /health (refusing in one
    sentence if it exits or times out) and stops it on leaving; output to `log`."""

    def __init__(self, command: list[str], port: int, log: Path, startup_timeout: float):
        self.command, self.log, self.startup_timeout = command, log, startup_timeout
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> VllmServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = os.environ | {"VLLM_SERVER_DEV_MODE": "1"}  # serves /reset_prefix_cache between runs
        with open(self.log, "wb") as log:
            try:
                self.process = subprocess.Popen(
                    self.command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            except OSError as err:
                raise KvprofError(
                    f"cannot run {self.command[0]} to start vLLM ({err.strerror}); pass --vllm-python with the "
                    "python of an environment that has vllm (e.g. make serve-env creates .venv-vllm)."
                ) from None
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def exit_code(self) -> int | None:
        """The server's exit code if it has exited, else None."""
        return self.process.poll() if self.process is not None else None

    def wait_ready(self) -> None:
        client = ServerClient(self.url, timeout=5)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.exit_code() is not None:
                raise KvprofError(self.describe_exit("during start-up"))
            if client.healthy():
                return
            time.sleep(0.5)
        raise KvprofError(
            f"the vLLM server did not come up within {self.startup_timeout:g} s (last log line: "
            f"{self.last_log_line()!r}); see {self.log}, or raise --startup-timeout."
        )

    def describe_exit(self, when: str) -> str:
        """One sentence: the server exited (`when`) with its code or signal and its log's most telling line."""
        code = self.exit_code()
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        return (
            f"the vLLM server {how} {when} (last log line: {self.last_log_line()!r}); see {self.log} for the whole log."
        )

    def last_log_line(self) -> str:
        """The log's first exception message outside warnings (a failed start's root cause), else its last line;
        shortened."""
        try:
            lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return ""
        for line in lines:
            found = EXCEPTION_MESSAGE.search(line)
            if found and "WARNING" not in line:
                return line[found.start() :][:300]
        return (lines or [""])[-1][-300:]

    def stop(self) -> None:
        """End the server's process group: SIGTERM, then SIGKILL after `STOP_GRACE_S`; wait for the server."""
        process = self.process
        if process is None:
            return
        for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            try:
                process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # the group may outlive its leader for a moment (engine workers): make sure none is left
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        self.process = None
