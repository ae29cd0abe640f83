"""An iteration-level model of a continuous-batching server, in the manner of vLLM's V1 scheduler
(docs/commands/simulate.md, "The engine").

Each step: running requests, oldest first, take tokens from the budget (a prefill chunk, or 1 decode token),
evicting idle kept state (`evict_kept`) and then preempting the newest request (recompute) when blocks run out; if
nothing was preempted, waiting requests are admitted FCFS; the step takes `StepCost.step_time`; finished requests send
their trajectory's next turn (seen `e` later).

Memory: capacity = `memory − weights` in blocks. A trajectory holds its `kept_bytes` blocks until it ends; a request
allocates the rest of its turn's `working_bytes` in proportion to the tokens computed. An evicted trajectory's next
turn prefills densely. Without eviction, a stall with nothing running is out of memory. Pure-decode steps are
advanced together in closed form. Times in seconds from the run's start.
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
    """The server: `token_budget` per step, `max_num_seqs`, `capacity_blocks` KV blocks of `block_size` tokens
    (`block_bytes` each); `evict_kept`: reclaim idle kept state when blocks run out (else hold it)."""

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
    """Arrivals: `load` (Poisson `qps` or closed-loop `concurrency`) until `duration` s, or `count` trajectories;
    trajectory k is the work's k mod n-th. `arrivals`: measured start times (open loop: all; closed loop: the first
    `concurrency`, else `CLOSED_LOOP_STAGGER` apart)."""

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
    """One run: per finished request TTFT, latency, time per output token after the first (TPOT, requests with more
    than one output token) in s, and tokens; finished trajectories; `duration`, `peak_blocks`, preemptions, steps,
    and `out_of_memory` (a sentence) if the run could not go on."""

    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    tokens: int = 0
    output_tokens: int = 0
    trajectories: int = 0  # trajectories whose last turn finished
    duration: float = 0.0
    peak_blocks: int = 0
    preemptions: int = 0
    evictions: int = 0
    steps: int = 0
    out_of_memory: str | None = None


class _Trajectory:
    """A trajectory in flight: work, next turn, kept blocks, whether evicted since its last turn."""

    __slots__ = ("work", "next_turn", "held", "evicted")

    def __init__(self, work: TrajectoryWork) -> None:
        self.work = work
        self.next_turn = 0
        self.held = 0
        self.evicted = False


class _Request:
    """A turn in the engine: `prompt` tokens (at `weight` each), prefill progress, outputs produced, KV tokens
    computed (`units`), its own blocks and blocks per computed token."""

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
    """One run's state: arrivals not yet seen, waiting and running requests, free blocks, clock."""

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
        """This step's (request, tokens), running first (preempting the newest if blocks run out), then waiting ones
        unless something was preempted; and whether it was."""
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
        """Recompute preemption: free the turn's blocks; it re-prefills prompt and outputs from the queue's head."""
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
        """Evict idle kept state, LRU first (not `keep`'s), until `need` blocks are free; their next turns prefill
        densely."""
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
        """Steps from this one that change only decode progress: all running requests decode, no admission possible,
        none finishes and no arrival starts before the last, and their blocks are free."""
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
        """(c × decoding weights + f × adapter ones + g if any; their K/V read this step; its growth per step)."""
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
        """Finish requests with all outputs: free the turn's blocks, keep kept blocks and send the next turn, or end
        the trajectory (freeing them; a closed loop starts another)."""
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
            if request.work.decode_steps > 1:
                result.tpot.append((self.now - request.first) / (request.work.decode_steps - 1))
            result.tokens += request.work.input_tokens + request.work.output_tokens
            result.output_tokens += request.work.output_tokens
            result.trajectories += ends
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
    """Seconds of a step: dense-equivalent prefill chunks and weighted decoding sequences, each reading its context."""
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
