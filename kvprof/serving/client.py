"""The HTTP client of an OpenAI-compatible completions server (vLLM's), standard library only. Completions are
streamed (to see the first token) and ask for generated ids (`return_token_ids`), cached prompt tokens
(`--enable-prompt-tokens-details`) and per-request timings (`--enable-per-request-metrics`). One `http.client`
connection per thread (`connection()`).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from dataclasses import dataclass, field

from kvprof.errors import KvprofError
from kvprof.serving.traffic import TurnRequest


class ServerError(KvprofError):
    """The server could not be reached, broke a connection, or answered something kvprof cannot use."""


@dataclass
class Completion:
    """One streamed completion, `perf_counter` times: `sent`, `first_token`, `done`, and `token_times` per generated
    token (tokens of one chunk share its time)."""

    model: str
    sent: float
    first_token: float
    done: float
    token_ids: list[int]
    prompt_token_ids: list[int] | None
    prompt_tokens: int
    cached_tokens: int | None
    server_timings: dict = field(default_factory=dict)
    token_times: list[float] = field(default_factory=list)


class ServerClient:
    """An OpenAI-compatible server at `url` (http://HOST:PORT); every call waits at most `timeout` s."""

    def __init__(self, url: str, timeout: float):
        parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parsed.scheme != "http" or not parsed.hostname:
            raise KvprofError(
                f"--url {url!r} is not an http://HOST:PORT address; pass e.g. --url http://127.0.0.1:8000."
            )
        self.url = f"http://{parsed.hostname}:{parsed.port or 80}"
        self.host, self.port, self.timeout = parsed.hostname, parsed.port or 80, timeout

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def _request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        connection = self.connection()
        try:
            connection.request(method, path, *self._encoded(body))
            response = connection.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException) as err:
            raise self.unreachable(err) from None
        finally:
            connection.close()

    @staticmethod
    def _encoded(body: dict | None) -> tuple:
        if body is None:
            return ()
        return json.dumps(body).encode(), {"Content-Type": "application/json"}

    def unreachable(self, err: BaseException) -> ServerError:
        """The error of a connection that failed: refused, reset, closed early or timed out."""
        if isinstance(err, (socket.timeout, TimeoutError)):
            return ServerError(
                f"the server at {self.url} did not answer within {self.timeout:g} s; raise --request-timeout or "
                "lower the load."
            )
        return ServerError(
            f"the server at {self.url} cannot be reached or closed the connection ({err or type(err).__name__}); "
            "check that it is running (or let kvprof start one with --start)."
        )

    def get_json(self, path: str) -> dict:
        status, body = self._request("GET", path)
        return self._json(path, status, body)

    def post_json(self, path: str, payload: dict) -> dict:
        status, body = self._request("POST", path, payload)
        return self._json(path, status, body)

    def _json(self, path: str, status: int, body: bytes) -> dict:
        try:
            answer = json.loads(body or b"null")
        except json.JSONDecodeError:
            answer = None
        if status != 200 or not isinstance(answer, dict):
            raise ServerError(
                f"the server at {self.url} answered {path} with HTTP {status} ({error_message(answer, body)}); "
                "pass the address of a vLLM OpenAI-compatible server."
            )
        return answer

    def healthy(self) -> bool:
        """Whether GET /health answers 200 now (False while the server is still starting)."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=2)
        try:
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            connection.close()

    def models(self) -> list[dict]:
        """GET /v1/models: the served models (a LoRA adapter has its base model as `parent`)."""
        return list(self.get_json("/v1/models").get("data", []))

    def version(self) -> str | None:
        """GET /version: the engine's version (vLLM serves it), None if the server does not say."""
        status, body = self._request("GET", "/version")
        answer = _parsed(body) if status == 200 else None
        return str(answer["version"]) if isinstance(answer, dict) and "version" in answer else None

    def tokenize(self, model: str, text: str) -> list[int]:
        """vLLM's /tokenize of `text` with `model`'s tokenizer, without special tokens."""
        return list(
            self.post_json("/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})["tokens"]
        )

    def detokenize(self, model: str, tokens: list[int]) -> str:
        """vLLM's /detokenize of `tokens` with `model`'s tokenizer."""
        return str(self.post_json("/detokenize", {"model": model, "tokens": tokens})["prompt"])

    def metrics_text(self) -> str:
        """GET /metrics: the server's Prometheus exposition (empty if it has none)."""
        status, body = self._request("GET", "/metrics")
        return body.decode("utf-8", errors="replace") if status == 200 else ""

    def reset_prefix_cache(self) -> bool:
        """POST /reset_prefix_cache (vLLM serves it with VLLM_SERVER_DEV_MODE=1); whether the cache was reset."""
        status, _ = self._request("POST", "/reset_prefix_cache")
        return status == 200

    def complete(self, connection: http.client.HTTPConnection, request: TurnRequest) -> Completion:
        """Stream one greedy completion of `request`'s prompt ids, exactly its recorded output length (EOS
        ignored)."""
        payload = {
            "model": request.model,
            "prompt": request.prompt,
            "max_tokens": len(request.expected),
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        sent = time.perf_counter()
        try:
            connection.request("POST", "/v1/completions", *self._encoded(payload))
            response = connection.getresponse()
            if response.status != 200:
                body = response.read()
                raise ServerError(
                    f"the server at {self.url} refused a completion for model {request.model!r} with HTTP "
                    f"{response.status} ({error_message(_parsed(body), body)}); serve that model or pick another "
                    "--pattern."
                )
            return self._read_stream(response, request, sent)
        except (OSError, http.client.HTTPException) as err:
            connection.close()
            raise self.unreachable(err) from None

    def _read_stream(self, response: http.client.HTTPResponse, request: TurnRequest, sent: float) -> Completion:
        token_ids: list[int] = []
        token_times: list[float] = []
        prompt_ids: list[int] | None = None
        first_token = 0.0
        usage: dict = {}
        timings: dict = {}
        model = request.model
        while True:
            line = response.readline()
            if not line:
                raise ServerError(
                    f"the server at {self.url} ended a completion stream for model {request.model!r} before "
                    "'data: [DONE]'; check the server's log."
                )
            text = line.decode("utf-8", errors="replace").strip()
            if not text.startswith("data:"):
                continue
            data = text[len("data:") :].strip()
            if data == "[DONE]":
                response.read()  # the end of the chunked body: the connection is then free for the next request
                break
            chunk = _parsed(data.encode())
            if not isinstance(chunk, dict) or "error" in chunk:
                raise ServerError(
                    f"the server at {self.url} failed a completion for model {request.model!r} "
                    f"({error_message(chunk, data.encode())}); check the server's log."
                )
            model = str(chunk.get("model", model))
            for choice in chunk.get("choices") or []:
                if choice.get("prompt_token_ids") is not None:
                    prompt_ids = list(choice["prompt_token_ids"])
                ids = choice.get("token_ids")
                if ids is None and choice.get("text"):
                    raise ServerError(
                        f"the server at {self.url} does not return generated token ids (return_token_ids); "
                        "serve-bench needs vLLM 0.10.2 or newer."
                    )
                if ids:
                    arrived = time.perf_counter()
                    first_token = first_token or arrived
                    token_times += [arrived] * len(ids)
                token_ids += ids or []
            if chunk.get("usage"):
                usage = chunk["usage"]
                timings = chunk.get("metrics") or {}
        done = time.perf_counter()
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            model=model,
            sent=sent,
            first_token=first_token or done,
            done=done,
            token_ids=token_ids,
            prompt_token_ids=prompt_ids,
            prompt_tokens=int(usage.get("prompt_tokens", len(request.prompt))),
            cached_tokens=details.get("cached_tokens"),
            server_timings=timings,
            token_times=token_times,
        )


def _parsed(body: bytes) -> object:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def error_message(answer: object, body: bytes) -> str:
    """An OpenAI-style error's message ({"error": {"message"}} or FastAPI's {"detail"}), else the body's start."""
    if isinstance(answer, dict):
        error = answer.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if answer.get("detail"):
            return str(answer["detail"])
    return body[:200].decode("utf-8", errors="replace").strip() or "no body"
