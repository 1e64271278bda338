"""Prompt-state persistence: Zarr v3 over fsspec (file://, s3://) with a commit protocol.

The only package that builds URIs or touches fsspec/zarr. Entry points:
open_state_writer / open_persisting_writer (write, resume, commit), open_committed_state (read),
verify_state, list_states / collect_garbage, and the `state` CLI sub-app in storage.state_commands.
"""

from longstraw.storage.background import BackgroundStateWriter, open_persisting_writer
from longstraw.storage.cache import CommittedStateLRU, default_state_lru
from longstraw.storage.errors import (
    ChunkChecksumError,
    ShardConflictError,
    StateIntegrityError,
    StateKeyMismatchError,
    StateNotCommittedError,
)
from longstraw.storage.reader import (
    CommittedState,
    naive_read_committed_state,
    open_committed_state,
    read_manifest,
    verify_state,
)
from longstraw.storage.writer import ShardData, StateWriter, open_state_writer

__all__ = [
    "BackgroundStateWriter",
    "ChunkChecksumError",
    "CommittedState",
    "CommittedStateLRU",
    "ShardConflictError",
    "ShardData",
    "StateIntegrityError",
    "StateKeyMismatchError",
    "StateNotCommittedError",
    "StateWriter",
    "default_state_lru",
    "naive_read_committed_state",
    "open_committed_state",
    "open_persisting_writer",
    "open_state_writer",
    "read_manifest",
    "verify_state",
]
