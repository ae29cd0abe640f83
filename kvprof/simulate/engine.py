"""An iteration-level model of a continuous-batching server, in the manner of vLLM's V1 scheduler.

Each step:

1. the running requests, oldest first, get tokens from the step's token budget: a request still prefilling its
   next chunk (chunked prefill: as many of its remaining prefill tokens as the budget has left), a decoding one 1
   token. Each needs KV blocks for what it computes; when the free blocks do not suffice, idle trajectories' kept
   state is evicted first (`evict_kept`, see Memory), then the newest running request is preempted (recompute: its
   turn's blocks are freed, it goes back to the head of the waiting queue, and when rescheduled it prefills its
   prompt and the tokens it had produced again);
2. if nothing was preempted, waiting requests are admitted first come, first served, while fewer than
   `max_num_seqs` run, budget is left and the head's first chunk finds blocks, evicting idle kept state if need be
   (otherwise admission stops);
3. the step takes `StepCost.step_time` of what it computed; a request whose prefill completes samples its first
   token at the end of the step (its TTFT), a decoding one its next token; a request that has all its output tokens
   finishes, and its trajectory sends its next turn at once (`e` later the engine sees it).

Memory: the KV capacity is `memory − weights` in blocks of `block_size` tokens × the model's KV bytes per token.
A trajectory holds the blocks of the bytes its policy keeps between turns (`kept_bytes` of its last turn) until
it ends; a request allocates the rest of its turn's peak (`working_bytes − held`) in proportion to the tokens it
has computed, and frees it when it finishes (keeping `kept_bytes`). With `evict_kept` (vLLM's way: cached blocks no
running request holds are reclaimed before anything is preempted), a request that lacks blocks first evicts the kept
state of idle trajectories (between turns, or waiting), least recently used first; such a trajectory's next turn
prefills its whole input as a dense recompute (weight 1). Without it, kept state stays until the trajectory ends,
and if nothing runs and the head of the queue cannot get its blocks, the kept caches of the trajectories in flight
have filled the memory: the run is out of memory. Steps in which every running request only decodes and nothing
can change are advanced together (their times summed in closed form), which is what makes an hour of traffic take
seconds.

Times are seconds from the start of the run.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from kvprof.serving.traffic import Load, poisson_arrivals
from kvprof.simulate.cost import StepCost
from kvprof.simulate.workload import RequestWork, TrajectoryWork

BLOCK_SIZE = 16
TOKEN_BUDGET = 8192
MAX_NUM_SEQS = 256
CLOSED_LOOP_STAGGER = 1e-3  # s between a closed loop's first trajectories (a client opens its connections in turn;
# started at one instant, trajectories with the same first turns would be prefilled in lockstep for good)


@dataclass(frozen=True)
class EngineConfig:
    """The server: tokens per step (`token_budget`), concurrent sequences (`max_num_seqs`), KV blocks of
    `block_size` tokens, each `block_bytes` bytes, and `capacity_blocks` of them; `evict_kept`: idle trajectories'
    kept state is reclaimed when blocks run out (else held until the trajectory ends)."""

    capacity_blocks: int
    block_bytes: float
    token_budget: int = TOKEN_BUDGET
    max_num_seqs: int = MAX_NUM_SEQS
    block_size: int = BLOCK_SIZE
    evict_kept: bool = True

    @classmethod
    def from_memory(cls, kv_bytes: float, kv_bytes_per_token: float, **options) -> EngineConfig:
        """A server with `kv_bytes` of KV memory (the budget minus the weights) for a model of `kv_bytes_per_token`."""
        block_bytes = kv_bytes_per_token * options.get("block_size", BLOCK_SIZE)
        return cls(capacity_blocks=int(kv_bytes // block_bytes), block_bytes=block_bytes, **options)


@dataclass(frozen=True)
class Traffic:
    """How trajectories arrive: `load` (Poisson `qps` or closed-loop `concurrency`), until `duration` seconds (no new
    trajectory after it) or, for `count`, that many trajectories; trajectory k is the work's k mod n-th.
    `arrivals`, if given, are the start times themselves (a measured run's): every trajectory's in an open loop, the
    first `concurrency` trajectories' in a closed loop (else they start `CLOSED_LOOP_STAGGER` apart)."""

    load: Load
    duration: float | None = None
    count: int | None = None
    seed: int = 0
    arrivals: tuple[float, ...] | None = None

    def open_loop_arrivals(self) -> list[float]:
        """Start times of the trajectories of an open-loop load."""
        if self.arrivals is not None:
            return list(self.arrivals)
        if self.count is not None:
            return poisson_arrivals(self.count, self.load.value, self.seed)
        expected = self.load.value * (self.duration or 0.0)
        times = poisson_arrivals(int(expected + 10 * math.sqrt(expected) + 10), self.load.value, self.seed)
        return [t for t in times if t < (self.duration or 0.0)]


@dataclass
class RunResult:
    """What one simulated run produced: per finished request its TTFT, end-to-end latency (s) and tokens (input +
    output); the run's `duration` (s, start to the last finish), `peak_blocks` used, preemptions, steps, and
    `out_of_memory` (a sentence) when the run could not go on."""

    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    tokens: int = 0
    output_tokens: int = 0
    duration: float = 0.0
    peak_blocks: int = 0
    preemptions: int = 0
    evictions: int = 0
    steps: int = 0
    out_of_memory: str | None = None


class _Trajectory:
    """A trajectory in flight: its work, the index of its next turn, the blocks it keeps between turns, and whether
    they were evicted since its last turn."""

    __slots__ = ("work", "next_turn", "held", "evicted")

    def __init__(self, work: TrajectoryWork) -> None:
        self.work = work
        self.next_turn = 0
        self.held = 0
        self.evicted = False


class _Request:
    """A turn in the engine: the tokens its prefill computes (`prompt`, at `weight` dense-equivalents each), prefill
    progress (tokens), output tokens produced, tokens of KV computed (`units`), blocks of the turn's own memory, and
    the blocks per computed token it allocates."""

    __slots__ = (
        "traj", "work", "sent", "first", "prompt", "weight", "prefill_total", "prefill_done", "decoded", "units",
        "blocks", "rate",
    )  # fmt: skip

    def __init__(self, traj: _Trajectory, sent: float, block_bytes: float) -> None:
        work = traj.work.requests[traj.next_turn]
        self.traj, self.work, self.sent, self.first = traj, work, sent, -1.0
        self.prompt, self.weight = work.prefill_tokens, work.prefill_weight
        self.prefill_total, self.prefill_done, self.decoded, self.units, self.blocks = work.prefill_tokens, 0, 0, 0, 0
        self.rate = 0.0
        if traj.evicted:
            self.recompute_all(block_bytes)
        else:
            self._size(traj.held, block_bytes)

    def _size(self, held: int, block_bytes: float) -> None:
        extra = max(0.0, self.work.working_bytes - held * block_bytes)
        self.rate = extra / block_bytes / (self.prompt + max(0, self.work.decode_steps - 1))

    def recompute_all(self, block_bytes: float) -> None:
        """Its trajectory's kept state was evicted before the turn started: it prefills its whole input densely."""
        self.traj.evicted = False
        self.prompt, self.weight = max(self.work.prefill_tokens, self.work.input_tokens), 1.0
        self.prefill_total = self.prompt + self.decoded
        self._size(0, block_bytes)

    def blocks_at(self, units: int) -> int:
        """Blocks of the turn's own memory once `units` tokens are computed."""
        return math.ceil(self.rate * units - 1e-9)

    def prefilling(self) -> bool:
        return self.prefill_done < self.prefill_total


def single_request_fits(work: RequestWork, config: EngineConfig) -> bool:
    """Whether a request's peak memory fits the whole KV capacity."""
    return math.ceil(work.working_bytes / config.block_bytes - 1e-9) <= config.capacity_blocks


def simulate(
    trajectories: tuple[TrajectoryWork, ...], cost: StepCost, config: EngineConfig, traffic: Traffic
) -> RunResult:
    """Serve `trajectories` under `traffic` on the modelled server (see the module docstring)."""
    return _Engine(trajectories, cost, config, traffic).run()


class _Engine:
    """One run's state: the event queue of requests not yet seen by the engine, the waiting queue, the running
    requests, free KV blocks, the clock."""

    def __init__(
        self, trajectories: tuple[TrajectoryWork, ...], cost: StepCost, config: EngineConfig, traffic: Traffic
    ) -> None:
        self.trajectories, self.cost, self.config, self.traffic = trajectories, cost, config, traffic
        self.result = RunResult()
        self.events: list[tuple[float, int, _Trajectory]] = []  # (time the engine sees it, tie-break, trajectory)
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.idle: dict[_Trajectory, None] = {}  # trajectories holding kept blocks, none running: least recent first
        self.idle_blocks = 0
        self.free, self.used, self.now, self.started, self.ticket = config.capacity_blocks, 0, 0.0, 0, 0

    def run(self) -> RunResult:
        traffic = self.traffic
        if traffic.load.kind == "concurrency":
            first = int(traffic.load.value)
            starts = list(traffic.arrivals or ())
            for k in range(first if traffic.count is None else min(first, traffic.count)):
                self._start(starts[k] if k < len(starts) else k * CLOSED_LOOP_STAGGER)
        else:
            for moment in traffic.open_loop_arrivals():
                self._start(moment)
        while self._step():
            pass
        self.result.duration = self.now
        return self.result

    def _start(self, moment: float) -> None:
        """A new trajectory sends its first turn at `moment`."""
        work = self.trajectories[self.started % len(self.trajectories)]
        self.started += 1
        self._send(_Trajectory(work), moment)

    def _send(self, traj: _Trajectory, moment: float) -> None:
        self.ticket += 1
        heapq.heappush(self.events, (moment + self.cost.e, self.ticket, traj))

    def _step(self) -> bool:
        """One engine step (or several identical decode steps); False when the run is over."""
        while self.events and self.events[0][0] <= self.now:
            seen, _, traj = heapq.heappop(self.events)
            self.waiting.append(_Request(traj, seen - self.cost.e, self.config.block_bytes))
        if not self.running and not self.waiting:
            if not self.events:
                return False
            self.now = self.events[0][0]
            return True
        scheduled, preempted = self._schedule()
        if self.result.out_of_memory:
            return False
        if not scheduled:
            if preempted:
                return True
            held = sum(r.traj.held for r in self.waiting)
            self.result.out_of_memory = (
                f"at {self.now:.1f} s the caches kept by {len(self.waiting)} trajectories in flight ({held} of "
                f"{self.config.capacity_blocks} KV blocks) leave too few blocks for the next request"
            )
            return False
        steps = 1 if preempted else self._steady_steps(scheduled)
        if steps > 1:
            self._advance_decodes(scheduled, steps)
        else:
            self.now += _step_time(scheduled, self.cost)
            for request, tokens in scheduled:
                self._progress(request, tokens)
        self.result.steps += steps
        self.result.peak_blocks = max(self.result.peak_blocks, self.used)
        self._finish_done()
        return True

    def _allocate(self, request: _Request, need: int) -> None:
        self.free -= need
        self.used += need
        request.blocks += need

    def _schedule(self) -> tuple[list[tuple[_Request, int]], bool]:
        """This step's (request, tokens): running requests first (preempting the newest when blocks run out), then
        waiting ones if nothing was preempted; and whether anything was."""
        scheduled: list[tuple[_Request, int]] = []
        budget, preempted, index = self.config.token_budget, False, 0
        running = self.running
        while index < len(running):
            request = running[index]
            tokens = min(request.prefill_total - request.prefill_done, budget) if request.prefilling() else 1
            if tokens <= 0 or budget <= 0:
                index += 1
                continue
            need = request.blocks_at(request.units + tokens) - request.blocks
            if need > self.free:
                self._reclaim(need, request.traj)
            while need > self.free and index < len(running):
                victim = running.pop()
                if victim is request and not running:
                    self.result.out_of_memory = (
                        f"at {self.now:.1f} s a request alone cannot get the blocks it needs next to the caches "
                        f"kept by {len(self.waiting)} waiting trajectories ({self.config.capacity_blocks} KV blocks)"
                    )
                    return scheduled, True
                self._preempt(victim)
                preempted = True
                self._reclaim(need, request.traj)  # the victim's kept state is idle now: evictable first
            if index >= len(running):
                break
            self._allocate(request, need)
            budget -= tokens
            scheduled.append((request, tokens))
            index += 1
        while not preempted and self.waiting and len(running) < self.config.max_num_seqs and budget > 0:
            request = self.waiting[0]
            tokens = min(request.prefill_total - request.prefill_done, budget)
            need = request.blocks_at(request.units + tokens) - request.blocks
            if need > self.free + self._evictable(request.traj):
                break  # as vLLM: nothing is evicted for a request that would not fit even so
            if need > self.free:
                self._reclaim(need, request.traj)
            self.waiting.popleft()
            self._busy(request.traj)
            running.append(request)
            self._allocate(request, need)
            budget -= tokens
            scheduled.append((request, tokens))
        return scheduled, preempted

    def _preempt(self, request: _Request) -> None:
        """Recompute preemption: the turn's blocks are freed; its prompt and the tokens it produced are prefilled
        again when it is rescheduled (from the head of the waiting queue)."""
        self.free += request.blocks
        self.used -= request.blocks
        request.prefill_total = request.prompt + request.decoded
        request.prefill_done = request.units = request.blocks = 0
        self.waiting.appendleft(request)
        self._idle(request.traj)
        self.result.preemptions += 1

    def _idle(self, traj: _Trajectory) -> None:
        """`traj` runs nothing now: its kept blocks become evictable, as its most recently used."""
        if self.config.evict_kept and traj.held and traj not in self.idle:
            self.idle[traj] = None
            self.idle_blocks += traj.held

    def _busy(self, traj: _Trajectory) -> None:
        """`traj`'s request runs: its kept blocks are its context, no longer evictable."""
        if traj in self.idle:
            del self.idle[traj]
            self.idle_blocks -= traj.held

    def _evictable(self, keep: _Trajectory) -> int:
        """Blocks `_reclaim` could free for a request of `keep`."""
        return self.idle_blocks - (keep.held if keep in self.idle else 0)

    def _reclaim(self, need: int, keep: _Trajectory) -> None:
        """Evict idle trajectories' kept state, least recently used first (not `keep`'s), until `need` blocks are
        free; their waiting requests, and their next turns, then prefill their whole input."""
        evicted = 0
        for traj in list(self.idle):
            if self.free >= need:
                break
            if traj is keep:
                continue
            self._busy(traj)
            self.free += traj.held
            self.used -= traj.held
            traj.held, traj.evicted = 0, True
            evicted += 1
        if evicted:
            self.result.evictions += evicted
            for request in self.waiting:
                if request.traj.evicted:
                    request.recompute_all(self.config.block_bytes)

    def _progress(self, request: _Request, tokens: int) -> None:
        """After a step: the request computed `tokens`; completing a prefill or a decode step samples a token."""
        request.units += tokens
        if request.prefilling():
            request.prefill_done += tokens
            if request.prefilling():
                return
        request.decoded += 1
        if request.first < 0:
            request.first = self.now
            self.result.ttft.append(self.now - request.sent)

    def _steady_steps(self, scheduled: list[tuple[_Request, int]]) -> int:
        """How many steps, starting with this one, change nothing but decode progress: every running request
        decodes, no admission can happen (none waits, the sequence limit is reached, or the head lacks blocks —
        free blocks only shrink while decoding), no request finishes before the last of them, no new request arrives
        before the last of them starts, and the blocks they need are free."""
        running = self.running
        if len(scheduled) != len(running) or any(r.prefilling() or r.first < 0 for r in running):
            return 1
        if self.waiting and len(running) < self.config.max_num_seqs:
            head = self.waiting[0]
            tokens = min(head.prefill_total - head.prefill_done, self.config.token_budget - len(running))
            if tokens > 0 and head.blocks_at(head.units + tokens) - head.blocks <= self.free + self._evictable(
                head.traj
            ):
                return 1
        steps = min(r.work.decode_steps - r.decoded for r in running)
        if steps <= 1:
            return 1
        if self.events:
            steps = min(steps, self._steps_until(scheduled, self.events[0][0] - self.now))
        while steps > 1 and sum(r.blocks_at(r.units + steps) - r.blocks for r in running) > self.free:
            steps //= 2
        return max(1, steps)

    def _decode_terms(self, scheduled: list[tuple[_Request, int]]) -> tuple[float, float, float]:
        """(the per-step cost of the decoding sequences besides a and the K/V read: c × their weights, f × those
        running an adapter, g if any does; their K/V read this step, the read's growth per step)."""
        weight = sum(r.work.decode_weight for r, _ in scheduled)
        adapter_tokens = sum(1 for r, _ in scheduled if r.work.adapter)
        read = sum(r.work.decode_weight * (r.work.context_tokens + r.decoded) for r, _ in scheduled)
        adapters = self.cost.f * adapter_tokens + (self.cost.g if adapter_tokens else 0.0)
        return self.cost.c * weight + adapters, read, weight

    def _steps_until(self, scheduled: list[tuple[_Request, int]], gap: float) -> int:
        """The number of decode steps whose summed time first reaches `gap` seconds (at least 1)."""
        cost = self.cost
        sequences, read, growth = self._decode_terms(scheduled)
        base = cost.a + sequences + cost.d * read
        half = cost.d * growth / 2  # T(k) = base·k + half·k(k − 1)
        if half <= 0:
            return max(1, math.ceil(gap / base)) if base > 0 else 1
        linear = base - half
        return max(1, math.ceil((-linear + math.sqrt(linear * linear + 4 * half * gap)) / (2 * half)))

    def _advance_decodes(self, scheduled: list[tuple[_Request, int]], steps: int) -> None:
        """`steps` decode steps of every running request at once, their times summed in closed form."""
        cost = self.cost
        sequences, read, growth = self._decode_terms(scheduled)
        self.now += steps * (cost.a + sequences + cost.d * read) + cost.d * growth * steps * (steps - 1) / 2
        for request, _ in scheduled:
            need = request.blocks_at(request.units + steps) - request.blocks
            self._allocate(request, need)
            request.units += steps
            request.decoded += steps

    def _finish_done(self) -> None:
        """Requests with all their output tokens finish: the turn's blocks go, the trajectory keeps its kept bytes'
        blocks and sends its next turn now, or ends (freeing them; a closed loop then starts another trajectory)."""
        config, result = self.config, self.result
        still = []
        for request in self.running:
            if request.decoded < request.work.decode_steps:
                still.append(request)
                continue
            traj = request.traj
            kept = math.ceil(request.work.kept_bytes / config.block_bytes - 1e-9)
            traj.next_turn += 1
            ends = traj.next_turn == len(traj.work.requests)
            released = traj.held + request.blocks - (0 if ends else kept)
            self.free += released
            self.used -= released
            traj.held = 0 if ends else kept
            if not ends:
                self._idle(traj)
            result.e2e.append(self.now - request.sent)
            result.tokens += request.work.input_tokens + request.work.output_tokens
            result.output_tokens += request.work.output_tokens
            if not ends:
                self._send(traj, self.now)
            elif self.traffic.load.kind == "concurrency" and self._more_trajectories():
                self._start(self.now)
        self.running[:] = still

    def _more_trajectories(self) -> bool:
        traffic = self.traffic
        if traffic.count is not None:
            return self.started < traffic.count
        return self.now < (traffic.duration or 0.0)


def _step_time(scheduled: list[tuple[_Request, int]], cost: StepCost) -> float:
    """Seconds of one step: prefill chunks in dense-equivalent tokens reading their context so far, decoding
    sequences by their decode weight reading their context."""
    prefill = decode = read = adapter_tokens = 0.0
    for request, tokens in scheduled:
        work = request.work
        adapter_tokens += tokens * work.adapter
        if request.prefilling():
            prefill += tokens * request.weight
            read += work.context_tokens * (request.prefill_done + tokens) / request.prefill_total
        else:
            decode += work.decode_weight
            read += work.decode_weight * (work.context_tokens + request.decoded)
    return cost.step_time(prefill, decode, read, adapter_tokens)
