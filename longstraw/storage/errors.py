"""Errors raised by the storage layer; each message says what to do about it."""

from __future__ import annotations

import os
import re
from pathlib import Path

_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")


def as_os_error(err: Exception, path: Path | str) -> Exception:
    """safetensors (Rust) reports a failed write as `SafetensorError: ... (os error 28)`: the
    OSError it is, naming `path`, so that the fault is said as what it is (disk full,
    read-only). Anything else (an OSError too) is returned as it is."""
    match = None if isinstance(err, OSError) else _OS_ERROR_IN_TEXT.search(str(err))
    if match is None:
        return err
    code = int(match.group(1))
    return OSError(code, os.strerror(code), str(path))


class StateNotCommittedError(FileNotFoundError):
    """No COMMITTED.json where a committed state was expected (never written, or the writer died)."""


class StateKeyMismatchError(ValueError):
    """What a stored state was computed from (weights, policy version, shard size, layout: its
    key) is not what this reader or writer expects. The engine's check that a recomputed shard
    reproduces the stored bytes is `longstraw.engine.recomputed_span.RecomputedStateMismatchError`."""


class StateIntegrityError(ValueError):
    """Stored bytes do not match their manifest."""


class ChunkChecksumError(StateIntegrityError):
    """A chunk's sha256 differs from the manifest (or the chunk is missing or has the wrong size)."""

    def __init__(self, array: str, index: tuple[int, ...], uri: str, detail: str):
        self.array = array
        self.index = index
        self.uri = uri
        super().__init__(f"array {array!r} chunk {index}: {detail} ({uri})")


class ShardConflictError(RuntimeError):
    """Another writer already recorded this shard with different bytes: this writer's later shards
    would be built on a state that is not the recorded one. Reopen with resume=True."""
