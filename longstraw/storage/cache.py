"""Process-local cache of committed states, keyed by manifest digest: a state written in this
process reads back as the very tensors the engine holds, with no I/O (the single-machine path)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from longstraw.schemas.storage import PrefixStateRef, StateLayout


@dataclass(frozen=True)
class CachedState:
    ref: PrefixStateRef
    layout: StateLayout
    tensors: dict[str, torch.Tensor]
    """name -> full array ([L, T, ...] or [L, S+1, ...]); shared with the writer, never copied."""


class CommittedStateLRU:
    """LRU over committed states by ref.manifest_sha256, bounded by the bytes it references."""

    def __init__(self, max_bytes: int = 64 * 2**30):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, CachedState] = OrderedDict()
        self._lock = threading.Lock()

    def put(
        self, ref: PrefixStateRef, layout: StateLayout, tensors: dict[str, torch.Tensor]
    ) -> None:
        for a in layout.arrays:
            t = tensors.get(a.name)
            if t is None or tuple(t.shape) != a.shape:
                raise ValueError(
                    f"cache entry for {ref.uri}: {a.name} has shape "
                    f"{None if t is None else tuple(t.shape)}, the layout says {a.shape}"
                )
        with self._lock:
            self._entries[ref.manifest_sha256] = CachedState(ref, layout, dict(tensors))
            self._entries.move_to_end(ref.manifest_sha256)
            while len(self._entries) > 1 and self._bytes() > self.max_bytes:
                self._entries.popitem(last=False)

    def get(self, manifest_sha256: str) -> CachedState | None:
        with self._lock:
            entry = self._entries.get(manifest_sha256)
            if entry is not None:
                self._entries.move_to_end(manifest_sha256)
            return entry

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for e in self._entries.values() for t in e.tensors.values()
        )


default_state_lru = CommittedStateLRU()
"""The cache writers fill on commit(tensors=...) and open_committed_state consults by default."""
