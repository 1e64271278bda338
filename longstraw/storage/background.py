"""BackgroundStateWriter: a StateWriter on a thread, so persisting shard k overlaps computing k+1.

Bounded by bytes in flight (write_shard blocks above StorageConfig.max_inflight_bytes; a single
shard larger than the bound still goes through alone). Tensors on an accelerator are copied to CPU
before they are queued; CPU tensors are queued as they are (the engine's state buffers are
append-only, so a shard's slice never changes after it is handed over). The first error of the
thread is raised by the next write_shard, and by commit() and close().
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Mapping

import torch

from longstraw.schemas.storage import PrefixStateRef, StateKey, StateLayout, StorageConfig
from longstraw.storage.cache import CommittedStateLRU, default_state_lru
from longstraw.storage.writer import ShardData, StateWriter


def _to_cpu(tensors: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    if tensors is None:
        return None
    return {
        n: (t.detach() if t.device.type == "cpu" else t.detach().to("cpu"))
        for n, t in tensors.items()
    }


def _nbytes(*groups) -> int:
    return sum(t.numel() * t.element_size() for g in groups if g for t in g.values())


class BackgroundStateWriter:
    """Same interface as StateWriter; writes happen on one background thread, in shard order."""

    def __init__(self, inner: StateWriter, max_inflight_bytes: int | None = None):
        self.inner = inner
        self.max_inflight_bytes = max_inflight_bytes or inner.config.max_inflight_bytes
        self._queue: deque = deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name="longstraw-state-writer", daemon=True
        )
        self._thread.start()

    # pass-throughs used before writing starts (resume)
    @property
    def attempt_id(self) -> str:
        return self.inner.attempt_id

    @property
    def layout(self):
        return self.inner.layout

    def completed_shards(self) -> list[int]:
        return self.inner.completed_shards()

    def next_shard(self) -> int:
        return self.inner.next_shard()

    def read_shard(self, k: int, *, verify: bool = True) -> ShardData:
        self.flush()
        return self.inner.read_shard(k, verify=verify)

    def write_shard(self, k, token_slices, checkpoints, initial_checkpoints=None) -> None:
        """Queue shard k (see StateWriter.write_shard); blocks while too many bytes are in flight."""
        self._raise_error()
        item = (k, _to_cpu(token_slices), _to_cpu(checkpoints), _to_cpu(initial_checkpoints))
        size = _nbytes(*item[1:])
        with self._cond:
            while (
                self._inflight > 0
                and self._inflight + size > self.max_inflight_bytes
                and self._error is None
            ):
                self._cond.wait()
            if self._closed:
                raise RuntimeError("write_shard after close()")
            self._queue.append((item, size))
            self._inflight += size
            self._cond.notify_all()
        self._raise_error()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                (k, tokens, ckpts, initial), size = self._queue[0]
            try:
                if self._error is None:
                    self.inner.write_shard(k, tokens, ckpts, initial)
            except BaseException as e:
                with self._cond:
                    self._error = e
            with self._cond:
                self._queue.popleft()
                self._inflight -= size
                self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every queued shard is written; raise the first error."""
        with self._cond:
            while self._queue:
                self._cond.wait()
        self._raise_error()

    def commit(
        self,
        *,
        tensors: Mapping[str, torch.Tensor] | None = None,
        cache: CommittedStateLRU | None = default_state_lru,
    ) -> PrefixStateRef:
        self.flush()
        return self.inner.commit(tensors=tensors, cache=cache)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self.inner.close()
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"background state write failed: {self._error}") from self._error

    def __enter__(self) -> BackgroundStateWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the caller's exception with ours
            with contextlib.suppress(Exception):
                self.close()


def open_persisting_writer(
    config: StorageConfig, key: StateKey, layout: StateLayout, *, resume: bool = False
) -> StateWriter | BackgroundStateWriter:
    """The writer config.persist_mode asks for: synchronous (StateWriter) or background.

    persist_mode="off" keeps the state in process memory only; it has no writer, so this raises:
    commit nothing and pass tensors around in-process instead.
    """
    if config.persist_mode == "off":
        raise ValueError(
            "persist_mode='off' persists nothing: do not open a writer (set persist_mode to "
            "'background' or 'synchronous' to persist the prompt state)"
        )
    inner = StateWriter(config, key, layout, resume=resume)
    if config.persist_mode == "synchronous":
        return inner
    return BackgroundStateWriter(inner, config.max_inflight_bytes)
