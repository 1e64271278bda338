"""Prompt-state persistence: Zarr v3 over fsspec (file://, s3://) with a commit protocol.

The only package that builds URIs or touches fsspec/zarr. Entry points:
open_state_writer / open_persisting_writer (write, resume, commit), open_committed_state (read),
verify_state, list_states / collect_garbage, and the `state` CLI sub-app in storage.state_commands.
"""

from __future__ import annotations

import importlib

# The public names, imported on first use (PEP 562) as in `longstraw/__init__.py`: importing one
# module of this package (the `state` commands, a config file reader) must not load torch and
# zarr before the CLI has answered `--help` or refused a config.
_EXPORTS = {
    "BackgroundStateWriter": "longstraw.storage.background",
    "open_persisting_writer": "longstraw.storage.background",
    "CommittedStateLRU": "longstraw.storage.cache",
    "default_state_lru": "longstraw.storage.cache",
    "ChunkChecksumError": "longstraw.storage.errors",
    "ShardConflictError": "longstraw.storage.errors",
    "StateIntegrityError": "longstraw.storage.errors",
    "StateKeyMismatchError": "longstraw.storage.errors",
    "StateNotCommittedError": "longstraw.storage.errors",
    "CommittedState": "longstraw.storage.reader",
    "naive_read_committed_state": "longstraw.storage.reader",
    "open_committed_state": "longstraw.storage.reader",
    "read_manifest": "longstraw.storage.reader",
    "verify_state": "longstraw.storage.reader",
    "ShardData": "longstraw.storage.writer",
    "StateWriter": "longstraw.storage.writer",
    "open_state_writer": "longstraw.storage.writer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'longstraw.storage' has no attribute {name!r}")
