"""A small stand-in for vLLM 0.32's OpenAI-compatible server (127.0.0.1 only), for serve-bench's tests and driver
benchmark: the same endpoints and streamed completions, set by `StubConfig`; it stops after `max_requests` or
`lifetime` s.

As a program (`python -m kvprof.serving.stub_server --port P --model M --lora-modules a=DIR ...`) it stands in for
vLLM behind `serve-bench --start`, configured by KVPROF_STUB (`StubConfig` JSON) and KVPROF_STUB_TRACE.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

STUB_VERSION = "stub"  # what it answers on /version


@dataclass
class StubConfig:
    """What the stub answers. `answers`: prompt ids → output ids (else `filler`); `texts`: text → ids for /tokenize;
    `ttft`, `per_token`: seconds; `shared_cache`: one prefix cache for all models (else per model, as vLLM per
    adapter); `answer_model`: the name answers carry (None: the one asked); `die_after`: completions before it
    breaks a stream and shuts down; `resettable`: /reset_prefix_cache exists."""

    base: str = "base"
    adapters: list[str] = field(default_factory=list)
    answers: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    texts: dict[str, list[int]] = field(default_factory=dict)
    filler: int = 1
    ttft: float = 0.0
    per_token: float = 0.0
    block_size: int = 16
    shared_cache: bool = False
    answer_model: str | None = None
    die_after: int | None = None
    resettable: bool = True
    max_model_len: int = 32768
    max_requests: int = 10_000
    lifetime: float = 120.0


class StubServer:
    """`with StubServer(config) as stub:` serves on `stub.url` in a thread until the block ends or it stops."""

    def __init__(self, config: StubConfig, port: int = 0):
        self.config = config
        self.lock = threading.Lock()
        self.cache: set[tuple[str, tuple[int, ...]]] = set()
        self.requests = 0
        self.completions = 0
        self.running = 0
        self.queries = 0
        self.hits = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), handler_for(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.timer = threading.Timer(config.lifetime, self.shutdown)
        self.timer.daemon = True
        self.stopped = threading.Event()

    def __enter__(self) -> StubServer:
        self.thread.start()
        self.timer.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.shutdown()
        self.thread.join(5)

    def shutdown(self) -> None:
        """Stop serving (from any thread) and close the listening socket."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        self.timer.cancel()
        threading.Thread(target=self._close, daemon=True).start()

    def _close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def cached_tokens(self, model: str, prompt: list[int]) -> int:
        """Whole cached blocks of `prompt` (at most all but its last token, which vLLM computes); then cache it."""
        key = "*" if self.config.shared_cache else model
        size = self.config.block_size
        blocks = [tuple(prompt[: (i + 1) * size]) for i in range(len(prompt) // size)]
        with self.lock:
            cached = 0
            for prefix in blocks:
                if (key, prefix) not in self.cache or len(prefix) >= len(prompt):
                    break
                cached = len(prefix)
            self.cache.update((key, prefix) for prefix in blocks)
            self.queries += len(prompt)
            self.hits += cached
        return cached

    def models(self) -> list[dict]:
        base = {"id": self.config.base, "object": "model", "parent": None, "max_model_len": self.config.max_model_len}
        return [base] + [{"id": name, "object": "model", "parent": self.config.base} for name in self.config.adapters]

    def metrics(self) -> str:
        labels = f'{{engine="0",model_name="{self.config.base}"}}'
        with self.lock:
            lines = [
                f"vllm:num_requests_running{labels} {self.running}",
                f"vllm:num_requests_waiting{labels} 0",
                f"vllm:kv_cache_usage_perc{labels} {min(1.0, len(self.cache) / 1000)}",
                f"vllm:prefix_cache_queries_total{labels} {self.queries}",
                f"vllm:prefix_cache_hits_total{labels} {self.hits}",
            ]
        return "\n".join(["# HELP vllm:num_requests_running stub", *lines]) + "\n"


class StubHandler(BaseHTTPRequestHandler):
    """The stub's HTTP endpoints; `handler_for` binds a subclass to one `StubServer`."""

    stub: ClassVar[StubServer]
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        """TCP_NODELAY, as uvicorn: Nagle's algorithm would hold small stream chunks until the delayed ACK."""
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        """Quiet: no access log."""

    def _count(self) -> bool:
        with self.stub.lock:
            self.stub.requests += 1
            over = self.stub.requests > self.stub.config.max_requests
        if over:
            self.stub.shutdown()
        return not over

    def _send(self, status: int, body: dict | str) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length", 0))
        return json.loads(self.rfile.read(length) or b"{}")

    def do_GET(self) -> None:
        if not self._count():
            return
        if self.path == "/health":
            self._send(200, "")
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": self.stub.models()})
        elif self.path == "/metrics":
            self._send(200, self.stub.metrics())
        elif self.path == "/version":
            self._send(200, {"version": STUB_VERSION})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        if not self._count():
            return
        body = self._body()
        if self.path == "/tokenize":
            self._send(200, {"tokens": self.stub.config.texts.get(body.get("prompt", ""), [])})
        elif self.path == "/detokenize":
            tokens = body.get("tokens", [])
            text = next((t for t, ids in self.stub.config.texts.items() if ids == tokens), "")
            self._send(200, {"prompt": text})
        elif self.path == "/reset_prefix_cache" and self.stub.config.resettable:
            with self.stub.lock:
                self.stub.cache.clear()
            self._send(200, "")
        elif self.path == "/v1/completions":
            self._complete(body)
        else:
            self._send(404, {"detail": "Not Found"})

    def _chunk(self, payload: dict | str) -> None:
        data = f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _complete(self, body: dict) -> None:
        model = body.get("model")
        if model not in [self.stub.config.base, *self.stub.config.adapters]:
            message = f"The model `{model}` does not exist."
            self._send(404, {"error": {"message": message, "type": "NotFoundError", "code": 404}})
            return
        prompt = list(body["prompt"])
        count = int(body["max_tokens"])
        with self.stub.lock:
            self.stub.completions += 1
            dying = self.stub.config.die_after is not None and self.stub.completions > self.stub.config.die_after
            self.stub.running += 1
        try:
            self._stream(model, prompt, count, dying)
        finally:
            with self.stub.lock:
                self.stub.running -= 1

    def _stream(self, model: str, prompt: list[int], count: int, dying: bool) -> None:
        queued = time.perf_counter()
        cached = self.stub.cached_tokens(model, prompt)
        answer = self.stub.config.answers.get(tuple(prompt), [])
        output = (answer + [self.stub.config.filler] * count)[:count]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        name = self.stub.config.answer_model or model
        time.sleep(self.stub.config.ttft)
        first = time.perf_counter()
        for index, token in enumerate(output):
            if index:
                time.sleep(self.stub.config.per_token)
            choice = {"index": 0, "text": f"<{token}>", "token_ids": [token], "finish_reason": None}
            if index == 0:
                choice["prompt_token_ids"] = prompt
            self._chunk({"object": "text_completion", "model": name, "choices": [choice]})
            if dying:
                self.stub.shutdown()
                self.close_connection = True
                self.wfile.flush()
                self.connection.close()
                return
        last = time.perf_counter()
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": count,
            "total_tokens": len(prompt) + count,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        metrics = {"queue_time_ms": 0.0, "time_to_first_token_ms": 1000 * (first - queued)}
        metrics["generation_time_ms"] = 1000 * (last - first)
        self._chunk({"object": "text_completion", "model": name, "choices": [], "usage": usage, "metrics": metrics})
        self._chunk("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def handler_for(stub: StubServer) -> type[StubHandler]:
    """A request handler class serving `stub`."""
    return type("Handler", (StubHandler,), {"stub": stub})


def trace_config(path: str, **overrides) -> StubConfig:
    """A config answering each turn of trace `path` with its output and tokenizing its texts to its ids; `overrides`
    set any field."""
    from kvprof.traces.trace import read_trace

    trace = read_trace(path)
    answers: dict[tuple[int, ...], list[int]] = {}
    texts: dict[str, list[int]] = {}
    for traj in trace.trajectories:
        for turn in traj.turns:
            answers[tuple(traj.input_tokens(turn))] = traj.output_tokens(turn)
        for segment in traj.segments.values():
            texts.setdefault(segment.text, segment.tokens)
    settings: dict = {"answers": answers, "texts": texts} | overrides
    return StubConfig(**settings)


def main(argv: list[str] | None = None) -> None:
    """Serve as a stand-in for `python -m vllm.entrypoints.openai.api_server` (see the module docstring)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--lora-modules", nargs="*", default=[])
    known, _ = parser.parse_known_args(argv)
    settings = json.loads(os.environ.get("KVPROF_STUB", "{}"))
    unknown = set(settings) - {f.name for f in fields(StubConfig)}
    if unknown:
        sys.exit(f"KVPROF_STUB has unknown fields {sorted(unknown)}")
    settings |= {"base": known.model, "adapters": [module.split("=", 1)[0] for module in known.lora_modules]}
    trace = os.environ.get("KVPROF_STUB_TRACE")
    config = trace_config(trace, **settings) if trace else StubConfig(**settings)
    with StubServer(config, port=known.port) as stub:
        stub.stopped.wait()
    sys.exit(3 if config.die_after is not None else 0)


if __name__ == "__main__":
    main()
