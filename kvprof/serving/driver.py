"""The load driver: a trace's traffic at one load, every request recorded. One thread and keep-alive connection per
trajectory in flight, turns in order; open loop (`qps`, Poisson starts) or closed loop (`concurrency`); a sampler
reads /metrics. After `max_seconds` no new turn is sent and cut trajectories are listed.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvprof.serving.client import Completion, ServerClient, ServerError
from kvprof.serving.prometheus import COUNTERS, GAUGES, metric_values
from kvprof.serving.traffic import Load, TrajectoryTraffic, TurnRequest, poisson_arrivals


@dataclass
class RequestRecord:
    """One request, seconds: `due` (since the run's start: the trajectory's arrival or the previous turn's answer),
    `send_delay` (how late it went out), `ttft` and `e2e` from sending, `tpot` (mean after the first token),
    `server_queue` (vLLM's per-request metrics), `token_times` from sending (one chunk shares a time)."""

    trajectory: str
    index: int
    agent: str
    agent_turn: int
    model: str
    due: float
    send_delay: float
    ttft: float
    tpot: float | None
    e2e: float
    server_queue: float | None
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens: int
    matches: bool
    first_mismatch: int | None
    token_times: list[float] = field(default_factory=list)


@dataclass
class LoadRun:
    """One (pattern, load) run: requests, wall time, unfinished trajectories, /metrics samples (s since start,
    gauges), prefix-cache counter growth."""

    pattern: str
    load: Load
    requests: list[RequestRecord]
    duration: float
    unfinished: list[str]
    samples: list[dict] = field(default_factory=list)
    prefix_cache: dict[str, float] = field(default_factory=dict)


def request_record(request: TurnRequest, completion: Completion, due: float, start: float) -> RequestRecord:
    """The record of `request` from what its `completion` returned (`start`: the run's perf_counter origin)."""
    ids, expected = completion.token_ids, request.expected
    mismatch = next((i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), None)
    if mismatch is None and len(ids) != len(expected):
        mismatch = min(len(ids), len(expected))
    decode = completion.done - completion.first_token
    queue_ms = completion.server_timings.get("queue_time_ms")
    return RequestRecord(
        trajectory=request.trajectory,
        index=request.index,
        agent=request.agent,
        agent_turn=request.agent_turn,
        model=request.model,
        due=due,
        send_delay=max(0.0, completion.sent - start - due),
        ttft=completion.first_token - completion.sent,
        tpot=decode / (len(ids) - 1) if len(ids) > 1 else None,
        e2e=completion.done - completion.sent,
        server_queue=None if queue_ms is None else float(queue_ms) / 1000,
        prompt_tokens=completion.prompt_tokens,
        cached_tokens=completion.cached_tokens,
        output_tokens=len(ids),
        matches=mismatch is None,
        first_mismatch=mismatch,
        token_times=[round(moment - completion.sent, 6) for moment in completion.token_times],
    )


class _Run:
    """The shared state of one run's threads: records, the first error, the stop signal."""

    def __init__(self, client: ServerClient, max_seconds: float, on_request: Callable[[RequestRecord], object]):
        self.client, self.on_request = client, on_request
        self.start = time.perf_counter()
        self.deadline = self.start + max_seconds
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.records: list[RequestRecord] = []
        self.finished: set[str] = set()
        self.error: BaseException | None = None

    def now(self) -> float:
        return time.perf_counter() - self.start

    def trajectory(self, traffic: TrajectoryTraffic, due: float) -> None:
        """Send `traffic`'s turns in order, from `due` on (run in a thread)."""
        connection = self.client.connection()
        try:
            for request in traffic.turns:
                if self.stop.is_set() or time.perf_counter() >= self.deadline:
                    return
                completion = self.client.complete(connection, request)
                check_answer(self.client, request, completion)
                record = request_record(request, completion, due, self.start)
                with self.lock:
                    self.records.append(record)
                self.on_request(record)
                due = completion.done - self.start
            with self.lock:
                self.finished.add(traffic.id)
        except BaseException as err:  # handed to the main thread, which raises it
            with self.lock:
                self.error = self.error or err
            self.stop.set()
        finally:
            connection.close()

    def sample(self, samples: list[dict], interval: float) -> None:
        """Read the gauges of /metrics every `interval` seconds until the run stops (run in a thread)."""
        while not self.stop.wait(interval):
            try:
                values = metric_values(self.client.metrics_text(), GAUGES)
            except ServerError:
                continue  # a sample lost; a dead server is the request threads' to report
            if values:
                samples.append({"t": round(self.now(), 3), **values})


def check_answer(client: ServerClient, request: TurnRequest, completion: Completion) -> None:
    """Refuse an answer from another model than the one asked, or for other prompt ids than those sent."""
    if completion.model != request.model:
        raise ServerError(
            f"the server at {client.url} answered a request for model {request.model!r} with model "
            f"{completion.model!r}; serve the trace's model and adapters under the names kvprof sends."
        )
    if completion.prompt_token_ids is not None and completion.prompt_token_ids != request.prompt:
        raise ServerError(
            f"the server at {client.url} processed other prompt ids than those sent for turn {request.index} of "
            f"trajectory {request.trajectory!r}; check the server's tokenizer settings."
        )


def _wait(threads: list[threading.Thread], run: _Run) -> None:
    """Join `threads` in short waits (so Ctrl-C reaches the main thread), stopping early on a thread's error."""
    for thread in threads:
        while thread.is_alive():
            thread.join(0.1)
            if run.error is not None:
                return


def run_load(
    client: ServerClient,
    traffic: list[TrajectoryTraffic],
    pattern: str,
    load: Load,
    seed: int,
    max_seconds: float,
    on_request: Callable[[RequestRecord], object] = lambda record: None,
    sample_interval: float = 0.5,
) -> LoadRun:
    """Drive `traffic` at `load`; raises the first request error (after stopping every thread)."""
    counters_before = metric_values(client.metrics_text(), COUNTERS)
    run = _Run(client, max_seconds, on_request)
    samples: list[dict] = []
    sampler = threading.Thread(target=run.sample, args=(samples, sample_interval), daemon=True)
    sampler.start()
    threads: list[threading.Thread] = []
    try:
        if load.kind == "qps":
            for traj, arrival in zip(traffic, poisson_arrivals(len(traffic), load.value, seed)):
                if run.stop.wait(max(0.0, arrival - run.now())) or time.perf_counter() >= run.deadline:
                    break
                thread = threading.Thread(target=run.trajectory, args=(traj, arrival), daemon=True)
                thread.start()
                threads.append(thread)
        else:
            pending = collections.deque(traffic)
            lock = threading.Lock()

            def worker() -> None:
                while not run.stop.is_set():
                    with lock:
                        if not pending:
                            return
                        traj = pending.popleft()
                    run.trajectory(traj, run.now())

            threads = [threading.Thread(target=worker, daemon=True) for _ in range(int(load.value))]
            for thread in threads:
                thread.start()
        _wait(threads, run)
    finally:
        run.stop.set()
    duration = run.now()
    sampler.join(2 * sample_interval + 5)
    if run.error is not None:
        raise run.error
    counters_after = metric_values(client.metrics_text(), COUNTERS)
    return LoadRun(
        pattern=pattern,
        load=load,
        requests=sorted(run.records, key=lambda r: (r.due, r.trajectory, r.index)),
        duration=duration,
        unfinished=[traj.id for traj in traffic if traj.id not in run.finished],
        samples=samples,
        prefix_cache={
            key: counters_after[key] - counters_before.get(key, 0.0) for key in counters_after if key in COUNTERS
        },
    )
