"""Atomic file writes (write to a temporary file beside the target, then rename over it), and JSONL reading.

A reader never sees a half-written result, and an interrupted command leaves the previous file intact.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from kvprof.errors import KvprofError


def jsonl_lines(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) for each non-blank line of a JSONL file; a line that is not JSON raises a
    `KvprofError` naming the file, the line and the parser's complaint."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise KvprofError(
                    f"{path} line {number} is not valid JSON ({err.msg} at column {err.colno}); fix that line."
                ) from None


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a temporary file next to `path`; on a clean exit it replaces `path`, on an exception it is removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, 0o666 & ~_umask())
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    """Write `payload` as indented JSON, atomically."""
    with atomic_open(path) as handle:
        json.dump(payload, handle, indent=2, sort_keys=False)
        handle.write("\n")
    return Path(path)


def _umask() -> int:
    """The process umask (reading it means setting it; it is set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
