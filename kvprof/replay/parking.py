"""Stored caches held within a budget (`--kv-budget`): the runs a replay steps in lockstep each keep their stores,
but only one runs at a time; the stores of runs not running move out of memory — to a file on CPU, to host memory
from a GPU — and come back before the run next touches them, as an engine's tiered KV cache moves blocks it does
not need now.

A run's stores are the storages of its `stored_tensors` (and of the last turn's cache a span-moving policy keeps):
each is written out whole, then resized to nothing, so every tensor and view over it stays in place and reads the
same bytes once it is resized back and read in. Nothing else changes: a replay under a budget computes the same
numbers. Moves happen between a run's turns, outside its timed prefills and decodes; their count, bytes and seconds
are reported (`ParkingReport`) apart from TTFT. (A run's workspaces are call-scoped: released when its call
ends, `kvprof.model.buffers.Workspace`.) The least recently run are parked first; the run about to run, and the
dense run while the policies compare against its turn, stay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from kvprof.policies import SharingPolicy


@dataclasses.dataclass
class ParkingReport:
    """What holding the stores within `budget_bytes` moved: `parks` (runs written out), `moved_bytes` (out and back
    in), `seconds` spent moving (not in any TTFT), `peak_resident_bytes` (the most stored bytes held at once)."""

    budget_bytes: int
    parks: int = 0
    moved_bytes: int = 0
    seconds: float = 0.0
    peak_resident_bytes: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """The tensors inside nested lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def held_storages(run: SharingPolicy) -> list[torch.UntypedStorage]:
    """The storages of everything `run` keeps between turns, each once (non-empty, resizable ones)."""
    tensors: Iterable[torch.Tensor] = [t for group in run.stored_tensors().values() for t in group]
    last_turn = getattr(run, "last_turn", None)
    if last_turn is not None:
        tensors = [*tensors, *_tensors(last_turn[3])]
    unique: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.resizable():
            unique.setdefault(storage.data_ptr(), storage)
    return list(unique.values())


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over `storage`'s bytes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclasses.dataclass
class _Parked:
    """A run's storages while parked and their sizes; on a GPU, their bytes in host memory."""

    storages: list[torch.UntypedStorage]
    sizes: list[int]
    host: list[torch.Tensor]


class StoreParking:
    """Holds the stored caches of lockstep runs within `budget_bytes` (module docstring); `holding(run)` around
    whatever touches a run's stores."""

    def __init__(self, budget_bytes: int):
        self.report = ParkingReport(budget_bytes)
        self._folder = tempfile.TemporaryDirectory(prefix="kvprof-parked-")
        self._parked: dict[int, _Parked] = {}
        self._recent: list[SharingPolicy] = []  # runs with resident stores, least recently run first

    def close(self) -> None:
        """Delete the parked files (every run's stores must be resident or no longer needed)."""
        self._folder.cleanup()

    def _file(self, run: SharingPolicy, index: int) -> Path:
        return Path(self._folder.name) / f"run-{id(run)}-{index}.bin"

    @staticmethod
    def resident_bytes(run: SharingPolicy) -> int:
        """Bytes of `run`'s stores in memory now."""
        return sum(storage.nbytes() for storage in held_storages(run))

    @contextlib.contextmanager
    def holding(self, run: SharingPolicy, keep: SharingPolicy | None = None) -> Iterator[None]:
        """`run`'s stores resident while the block runs: the least recently run others (not `keep`) parked first
        while the stores held would exceed the budget."""
        started = time.perf_counter()
        need = sum(self._parked[id(run)].sizes) if id(run) in self._parked else self.resident_bytes(run)
        others = [other for other in self._recent if other is not run]
        held = sum(self.resident_bytes(other) for other in others) + need
        for other in others:
            if held <= self.report.budget_bytes:
                break
            if other is not keep:
                held -= self._park(other)
        self._unpark(run)
        self._recent = [*(other for other in self._recent if other is not run), run]
        self.report.seconds += time.perf_counter() - started
        try:
            yield
        finally:
            resident = sum(self.resident_bytes(other) for other in self._recent)
            self.report.peak_resident_bytes = max(self.report.peak_resident_bytes, resident)

    def _park(self, run: SharingPolicy) -> int:
        """Write `run`'s stores out and free them; the bytes freed."""
        storages = held_storages(run)
        sizes = [storage.nbytes() for storage in storages]
        host = []
        for index, storage in enumerate(storages):
            if storage.device.type == "cpu":
                self._mapped(run, index, storage.nbytes()).copy_(storage)
            else:
                host.append(_as_bytes(storage).to("cpu"))
            storage.resize_(0)
        self._parked[id(run)] = _Parked(storages, sizes, host)
        self._recent = [other for other in self._recent if other is not run]
        self.report.parks += 1
        self.report.moved_bytes += sum(sizes)
        return sum(sizes)

    def _mapped(self, run: SharingPolicy, index: int, size: int) -> torch.UntypedStorage:
        """Storage `index` of `run` in its file (mapped while the caller holds it; a numpy view would make the
        run's storage unresizable)."""
        return torch.UntypedStorage.from_file(str(self._file(run, index)), shared=True, nbytes=size)

    def _unpark(self, run: SharingPolicy) -> None:
        """Bring `run`'s parked stores back (no-op if resident)."""
        parked = self._parked.pop(id(run), None)
        if parked is None:
            return
        for index, (storage, size) in enumerate(zip(parked.storages, parked.sizes)):
            storage.resize_(size)
            if storage.device.type == "cpu":
                storage.copy_(self._mapped(run, index, size))
                self._file(run, index).unlink()
            else:
                _as_bytes(storage).copy_(parked.host[index])
        self.report.moved_bytes += sum(parked.sizes)
