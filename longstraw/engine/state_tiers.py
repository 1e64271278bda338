"""Prompt state beyond the compute device: a resident budget, the rest streamed chunk by chunk.

Legend: L layers of one kind, T state tokens, X the trailing dims of one position (K×D, R, ...),
C rows per chunk (the attention kernels' prefix chunk, `prefix_chunk_tokens`).

A tiered state keeps every per-token array (full-attention K/V, MLA latents, rope and indexer
keys) and, in exact mode, their fp32 cotangent dS in a lower tier — host memory (`HostTier`) or
a local scratch file (`FileTier`) — and gives the cache layers `StreamedRows` in their place.
The attention kernels already read the prefix C rows at a time on a fixed grid (the prefix
partial: one flash call or one online-softmax step per chunk; the backward: one key chunk at a
time; MLA and the DSA indexer likewise), so each slice they take is one chunk: read from the
lower tier when asked for, freed when the kernel moves to another chunk of the same array, and
for a cotangent read-modify-written in fp32 (written back when freed). The next chunk of the
same rows is prefetched on a background thread while the current one computes; a forward
pre-hook on each decoder layer (and a hook before its backward) frees the previous layer's
chunks and starts reading the layer's first ones.

Whole layers whose state fits are kept resident for good (lowest layer index first), leaving
room in the budget for one working chunk of every streamed array of a layer (`chunk_unit_bytes`);
the prefetched chunks are the one allowance above it. Resident bytes are counted by the store
itself (on CPU "device" and "host" are one memory): peak resident ≤ max(budget, one chunk unit)
+ one chunk unit, so a budget far below one layer's state holds. Linear-attention checkpoints
are constant-size host tensors and stay as they are.

The kernels read the same values in the same order as a fully resident state: log-probs,
rollout tokens and gradients are bitwise equal (tests/engine/test_state_tiers.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel

from longstraw.engine.attention import prefix_chunk_tokens
from longstraw.engine.layer_kinds import TOKEN_ARRAYS, array_layer_indices
from longstraw.engine.state import WHOLE, Placement, PrefixState
from longstraw.models.adapters import decoder_of, state_spec
from longstraw.schemas.results import StateTraffic

# PrefixState fields that grow with the prompt, and whether exact mode keeps a cotangent of them.
STREAMED_FIELDS = {a.field: a.has_cotangent for a in TOKEN_ARRAYS}


@dataclass(frozen=True)
class StateBudget:
    """Where a budgeted prompt state lives (the run config's `engine.state_budget_bytes`,
    `state_tier`, `state_dir`; `exact`: keep the fp32 cotangent in the lower tier too)."""

    budget_bytes: int
    lower: str = "host"
    directory: str | None = None
    exact: bool = True

    @classmethod
    def of(cls, engine) -> StateBudget | None:
        """The budget of an `EngineConfig` (None: the state stays resident)."""
        if engine.state_budget_bytes is None:
            return None
        return cls(
            engine.state_budget_bytes,
            engine.state_tier,
            engine.state_dir,
            exact=engine.prompt_grad == "exact",
        )


class HostTier:
    """The lower tier in host memory: one [L, T, *X] tensor (pinned when CUDA is present)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self.tensor = torch.zeros(shape, dtype=dtype, pin_memory=torch.cuda.is_available())

    def read_into(self, slot: int, start: int, out: torch.Tensor) -> None:
        out.copy_(self.tensor[slot, start : start + out.shape[0]])

    def write_from(self, slot: int, start: int, src: torch.Tensor) -> None:
        self.tensor[slot, start : start + src.shape[0]].copy_(src)

    def zero(self) -> None:
        self.tensor.zero_()

    def close(self) -> None:
        self.tensor = None


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without `.numpy()` (which would pin the
    storage's size: the device buffers are emptied and refilled by resizing their storage)."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    size = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * size).from_address(tensor.data_ptr())).cast("B")


class FileTier:
    """The lower tier in a local scratch file: slot s, position t at byte (s * T + t) * row.

    Read and written with pread/pwrite into the caller's buffer: nothing is memory-mapped, so
    the process holds only the buffers it asked for (page cache aside).
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, directory: str | None):
        self.shape, self.dtype = shape, dtype
        self.row_bytes = torch.empty(shape[2:], dtype=dtype).numel() * dtype.itemsize
        fd, self.path = tempfile.mkstemp(prefix="longstraw-state-", suffix=".bin", dir=directory)
        self.fd = fd
        # A sparse file reads back as zeros: the initial value of a cotangent.
        os.ftruncate(fd, shape[0] * shape[1] * self.row_bytes)

    def zero(self) -> None:
        """Every byte zero again (the file emptied and regrown sparse)."""
        os.ftruncate(self.fd, 0)
        os.ftruncate(self.fd, self.shape[0] * self.shape[1] * self.row_bytes)

    def _offset(self, slot: int, start: int) -> int:
        return (slot * self.shape[1] + start) * self.row_bytes

    def read_into(self, slot: int, start: int, out: torch.Tensor) -> None:
        host = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype)
        view = _bytes_of(host)
        done = 0
        while done < len(view):
            done += os.preadv(self.fd, [view[done:]], self._offset(slot, start) + done)
        if host is not out:
            out.copy_(host)

    def write_from(self, slot: int, start: int, src: torch.Tensor) -> None:
        host = src.detach().cpu().contiguous()
        view = _bytes_of(host)
        done = 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], self._offset(slot, start) + done)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            os.unlink(self.path)
            self.fd = None


def _lower_tier(kind: str, shape, dtype, directory):
    if kind == "host":
        return HostTier(shape, dtype)
    if kind == "disk":
        return FileTier(shape, dtype, directory)
    raise ValueError(f"state tier must be 'host' or 'disk', got {kind!r}")


class StreamedRows:
    """Rows [0, end) of one slot of a `TieredArray`, as the attention kernels read them.

    The kernels slice the prefix on a fixed grid (`rows[s : s + C]`, C the store's
    `chunk_tokens`) and use each slice before asking for the next; every slice of one grid chunk
    is a view of that chunk's device buffer, read from the lower tier when first asked for and
    freed when the kernel moves on to another chunk of the same array. Cotangent rows are
    read-modify-written the same way (`rows[s:e].add_(...)`, `rows[s:e] += ...`). A slice across
    chunks is a copy, gathered chunk by chunk (read-only arrays only). Otherwise this answers
    the few tensor attributes the kernels check (shape, dtype, device, requires_grad, ...).
    """

    requires_grad = False
    _version = 0
    """Nothing writes into the stored state while a graph lives (checked by the kernels)."""

    def __init__(self, array: TieredArray, slot: int, end: int):
        self.array, self.slot, self.end = array, slot, end
        self.shape = torch.Size((end, *array.shape[2:]))
        self.dtype, self.device = array.dtype, array.device

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def __len__(self) -> int:
        return self.end

    def _bounds(self, key) -> tuple[int, int]:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise IndexError(f"{self.array.name}: streamed rows take [start:stop] slices only")
        start, stop, _ = key.indices(self.end)
        return start, max(start, stop)

    def __getitem__(self, key) -> torch.Tensor:
        start, stop = self._bounds(key)
        return self.array.store.rows(self.array, self.slot, start, stop, self.end)

    def __setitem__(self, key, value: torch.Tensor) -> None:
        target = self[key]
        # `rows[s:e] += x` adds into the chunk view in place, then assigns that same view back.
        if target.data_ptr() != value.data_ptr():
            target.copy_(value)


class TieredArray:
    """An [L, T, *X] array whose truth is in a lower tier; indexing hands out placeholders.

    `array[slot]` and `array[slot, :end]` (what the cache layers take) return the rows of a
    layer kept resident for good (a tensor), or `StreamedRows` for a streamed layer;
    `read(slot, start, end)` copies a slice out (what the sweep checks and seeds with).
    """

    def __init__(self, store: TieredStore, name: str, tier, shape, dtype, writable: bool):
        self.store, self.name, self.tier = store, name, tier
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = store.device
        self.writable = writable
        self.row_bytes = torch.Size(shape[2:]).numel() * dtype.itemsize

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def __getitem__(self, key):
        slot, end = (key, self.shape[1]) if isinstance(key, int) else key
        if isinstance(end, slice):
            if end.start not in (None, 0) or end.step not in (None, 1):
                raise IndexError(f"{self.name}: placeholders cover [:end]; use read() for slices")
            end = self.shape[1] if end.stop is None else min(end.stop, self.shape[1])
        slot, end = int(slot), int(end)
        if self.store.layer_of[(self.name, slot)] in self.store.permanent:
            return self.store.whole(self, slot)[:end]
        return StreamedRows(self, slot, end)

    def __setitem__(self, key, value: torch.Tensor) -> None:
        """`array[slot, start:stop] = rows`: a prefill writing its shard's rows (a state array;
        a cotangent is added into chunk by chunk through `StreamedRows` instead)."""
        slot, rows = key
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise IndexError(f"{self.name}: rows are written as [slot, start:stop]")
        start, stop, _ = rows.indices(self.shape[1])
        if stop - start != value.shape[0]:
            raise ValueError(
                f"{self.name}: {value.shape[0]} rows given for positions [{start}, {stop})"
            )
        self.store.write_rows(self, int(slot), start, value)

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """[end - start, *X] copy of the slice (pending writes flushed first)."""
        if self.store.layer_of[(self.name, slot)] in self.store.permanent:
            return self.store.whole(self, slot)[start:end].clone()
        self.store.flush_slot(self, slot)
        out = torch.empty((end - start, *self.shape[2:]), dtype=self.dtype, device=self.device)
        self.tier.read_into(slot, start, out)
        return out


@dataclass(eq=False)
class _Chunk:
    """The device copy of rows [start, start + len) of one slot of one array."""

    tensor: torch.Tensor
    dirty: bool = False

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass
class TieredStore:
    """The resident layers and streamed chunks of one tiered state, and the hooks that stream."""

    budget_bytes: int
    device: torch.device
    chunk_tokens: int
    """Rows per streamed chunk: the attention kernels' prefix chunk (`prefix_chunk_tokens`)."""
    unit_bytes: dict[int, int] = field(default_factory=dict)
    """Bytes per model layer: its state, plus its cotangent in exact mode."""
    chunk_unit_bytes: int = 0
    """One chunk of every streamed array of a layer (the largest such set): the working unit."""
    permanent: frozenset[int] = frozenset()
    """Model layers kept resident for good."""
    arrays: dict[str, TieredArray] = field(default_factory=dict)
    layer_of: dict[tuple[str, int], int] = field(default_factory=dict)
    """(array name, slot) -> model layer."""
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    bytes_read: int = 0
    """Read from the lower tier into device buffers."""
    bytes_written: int = 0
    """Written to the lower tier: a prefill's rows, cotangents written back."""
    prefetches: int = 0
    """Chunks read on the background thread ahead of their use."""

    def __post_init__(self):
        self._whole: dict[tuple[str, int], torch.Tensor] = {}
        self._chunks: dict[tuple[str, int, int], _Chunk] = {}
        self._pending: dict[tuple[str, int, int], Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="longstraw-prefetch")
        self._handles: list = []

    def _count(self, nbytes: int, *, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.resident_bytes += nbytes
            self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
            self.bytes_read += read
            self.bytes_written += written

    # -- layers kept for good -----------------------------------------------------------------

    def whole(self, array: TieredArray, slot: int) -> torch.Tensor:
        """[T, *X] of a permanent layer's slot, read once; a cotangent stays resident (its
        lower tier is not read again: `read` and the sweep use this buffer)."""
        key = (array.name, slot)
        tensor = self._whole.get(key)
        if tensor is None:
            tensor = torch.empty(array.shape[1:], dtype=array.dtype, device=self.device)
            array.tier.read_into(slot, 0, tensor)
            self._whole[key] = tensor
            nbytes = tensor.numel() * tensor.element_size()
            self._count(nbytes, read=nbytes)
        return tensor

    # -- streamed chunks ----------------------------------------------------------------------

    def _chunk_rows(self, array: TieredArray, index: int) -> tuple[int, int]:
        start = index * self.chunk_tokens
        return start, min(start + self.chunk_tokens, array.shape[1])

    def _load(self, array: TieredArray, slot: int, index: int) -> None:
        """Read chunk `index` of `array[slot]` into a new device buffer (either thread)."""
        start, end = self._chunk_rows(array, index)
        tensor = torch.empty((end - start, *array.shape[2:]), dtype=array.dtype, device=self.device)
        array.tier.read_into(slot, start, tensor)
        chunk = _Chunk(tensor)
        with self._lock:
            self._chunks[(array.name, slot, index)] = chunk
        self._count(chunk.nbytes, read=chunk.nbytes)

    def _keys(self) -> list[tuple[str, int, int]]:
        """Every chunk resident or being read (a snapshot: the prefetch thread adds to it)."""
        with self._lock:
            return list(dict.fromkeys([*self._chunks, *self._pending]))

    def _wait(self, key: tuple[str, int, int]) -> None:
        future = self._pending.pop(key, None)
        if future is not None:
            future.result()

    def _evict(self, key: tuple[str, int, int], *, write_back: bool = True) -> None:
        self._wait(key)
        with self._lock:
            chunk = self._chunks.pop(key, None)
        if chunk is None:
            return
        written = 0
        if chunk.dirty and write_back:
            name, slot, index = key
            array = self.arrays[name]
            array.tier.write_from(slot, self._chunk_rows(array, index)[0], chunk.tensor)
            written = chunk.nbytes
        nbytes = chunk.nbytes
        # Free the storage now, whatever still refers to it: a stale view then fails loudly.
        chunk.tensor.untyped_storage().resize_(0)
        self._count(-nbytes, written=written)

    def _prefetch(self, array: TieredArray, slot: int, index: int) -> None:
        key = (array.name, slot, index)
        if index * self.chunk_tokens >= array.shape[1] or key in self._pending:
            return
        with self._lock:
            if key in self._chunks:
                return
        self.prefetches += 1
        self._pending[key] = self._pool.submit(self._load, array, slot, index)

    def chunk(self, array: TieredArray, slot: int, index: int) -> torch.Tensor:
        """Chunk `index` of `array[slot]`, resident; every other chunk of `array` is freed
        (written back if the backward added into it)."""
        key = (array.name, slot, index)
        self._wait(key)
        for other in [k for k in self._keys() if k[0] == array.name]:
            if other != key:
                self._evict(other)
        if key not in self._chunks:
            self._load(array, slot, index)
        chunk = self._chunks[key]
        if array.writable:
            chunk.dirty = True
        return chunk.tensor

    def rows(self, array: TieredArray, slot: int, start: int, stop: int, end: int) -> torch.Tensor:
        """Rows [start, stop) of `array[slot]` (a view of one chunk when inside one), and the
        next chunk of the same rows [0, end) prefetched."""
        size = self.chunk_tokens
        if stop <= start:
            return torch.empty((0, *array.shape[2:]), dtype=array.dtype, device=self.device)
        index = start // size
        if (stop - 1) // size != index:
            if array.writable:
                raise IndexError(
                    f"{array.name}: a cotangent is added into one chunk of {size} rows at a "
                    f"time; got rows [{start}, {stop})"
                )
            return self._gathered(array, slot, start, stop, end)
        tensor = self.chunk(array, slot, index)
        if (index + 1) * size < end:
            self._prefetch(array, slot, index + 1)
        return tensor[start - index * size : stop - index * size]

    def _gathered(self, array, slot, start, stop, end) -> torch.Tensor:
        """A copy of rows [start, stop) that span chunks (a kernel on another grid)."""
        out = torch.empty((stop - start, *array.shape[2:]), dtype=array.dtype, device=self.device)
        size, lo = self.chunk_tokens, start
        while lo < stop:
            hi = min(stop, (lo // size + 1) * size)
            out[lo - start : hi - start].copy_(self.rows(array, slot, lo, hi, end))
            lo = hi
        return out

    def write_rows(self, array: TieredArray, slot: int, start: int, rows: torch.Tensor) -> None:
        """Store rows [start, start + len) of `array[slot]` in the lower tier; a resident copy of
        them (a permanent layer's buffer) is updated, a streamed chunk holding them is dropped
        (read again when next asked for)."""
        if array.writable:
            raise ValueError(f"{array.name}: a cotangent is added into, not written")
        end = start + rows.shape[0]
        whole = self._whole.get((array.name, slot))
        if whole is not None:
            whole[start:end].copy_(rows)
        for key in self._keys():
            if key[:2] == (array.name, slot):
                first, last = self._chunk_rows(array, key[2])
                if first < end and start < last:
                    self._evict(key, write_back=False)
        array.tier.write_from(slot, start, rows)
        self._count(0, written=rows.numel() * rows.element_size())

    def start_counting(self) -> None:
        """Count peak and traffic from here (a stage of a state tiered since its prefill)."""
        with self._lock:
            self.peak_resident_bytes = self.resident_bytes
            self.bytes_read = self.bytes_written = 0

    def reset_cotangents(self) -> None:
        """Every cotangent array zero again (a new backward starts)."""
        for name, array in self.arrays.items():
            if not array.writable:
                continue
            for key in [k for k in self._keys() if k[0] == name]:
                self._evict(key, write_back=False)
            for (whole_name, _), tensor in self._whole.items():
                if whole_name == name:
                    tensor.zero_()
            array.tier.zero()

    def flush_slot(self, array: TieredArray, slot: int) -> None:
        """Write back what the backward added into `array[slot]` and is still on the device."""
        for key in [k for k in self._keys() if k[:2] == (array.name, slot)]:
            self._evict(key)

    # -- layers -------------------------------------------------------------------------------

    def acquire(self, layer: int, *, backward: bool) -> None:
        """Entering `layer` (its forward, or its backward): free every chunk but this layer's
        first ones and start reading those (cotangents too when `backward`)."""
        if layer not in self.unit_bytes or layer in self.permanent:
            return
        for key in self._keys():
            if key[2] != 0 or self.layer_of[key[:2]] != layer:
                self._evict(key)
        for (name, slot), owner in self.layer_of.items():
            array = self.arrays[name]
            if owner == layer and (backward or not array.writable):
                self._prefetch(array, slot, 0)

    def release_all(self, *, write_back: bool = True) -> None:
        """Free every streamed chunk, written back unless `write_back` is False (the permanent
        layers are kept)."""
        for key in self._keys():
            self._evict(key, write_back=write_back)

    def attach(self, model: PreTrainedModel) -> None:
        """Hook every decoder layer of `model`: enter it before its forward and its backward."""

        def before_forward(module, args, layer):
            self.acquire(layer, backward=False)

        def after_forward(module, args, output, layer):
            hidden = output[0] if isinstance(output, tuple) else output
            if torch.is_grad_enabled() and hidden.requires_grad:

                def before_backward(grad):
                    self.acquire(layer, backward=True)
                    return grad

                hidden.register_hook(before_backward)

        for layer, module in enumerate(decoder_of(model).layers):
            self._handles.append(
                module.register_forward_pre_hook(
                    lambda m, a, layer=layer: before_forward(m, a, layer)
                )
            )
            self._handles.append(
                module.register_forward_hook(
                    lambda m, a, o, layer=layer: after_forward(m, a, o, layer)
                )
            )

    def close(self) -> None:
        """Remove the hooks, stop the prefetcher and delete the lower tier's scratch files (what
        is still on the device is dropped: nothing reads this state again)."""
        self.release_all(write_back=False)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pool.shutdown(wait=True)
        self._whole.clear()
        for array in self.arrays.values():
            array.tier.close()


def state_traffic(state) -> StateTraffic | None:
    """The tiered store's peak resident bytes and bytes moved so far (None: `state` resident)."""
    tiers = getattr(state, "tiers", None)
    if tiers is None:
        return None
    store = tiers.store
    return StateTraffic(
        peak_resident_bytes=store.peak_resident_bytes,
        bytes_read=store.bytes_read,
        bytes_written=store.bytes_written,
    )


class TieredState:
    """A `PrefixState` whose per-token arrays live in a lower tier (`tier_state`)."""

    def __init__(self, state: PrefixState, store: TieredStore):
        self.state = state
        self.store = store

    def cotangent(self):
        """A zero `PromptCotangent` whose per-token parts live in the lower tier too (the same
        arrays each call, zeroed again: one backward at a time reads a tiered state)."""
        from longstraw.engine.replay import PromptCotangent

        self.store.reset_cotangents()
        streamed = [name for name, has_cotangent in STREAMED_FIELDS.items() if has_cotangent]
        plain = replace(self.state, tiers=None, **dict.fromkeys(streamed))
        dense = PromptCotangent.zeros_like_state(plain)
        return replace(dense, **{name: self.store.arrays.get(f"d{name}") for name in streamed})

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> TieredState:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tier_state(
    model: PreTrainedModel,
    state: PrefixState,
    *,
    budget_bytes: int,
    lower: str = "host",
    directory: str | None = None,
    exact: bool = True,
    chunk_tokens: int | None = None,
) -> TieredState:
    """Move `state`'s per-token arrays into the `lower` tier ("host" or "disk": a scratch file in
    `directory`) and stream them through `model` under `budget_bytes` of device memory.

    `exact` keeps each layer's fp32 cotangent in the same lower tier and counts it in the
    budget; `chunk_tokens` as in `tiered_from_sources`. The returned `TieredState.state` replaces `state` everywhere (replay, rollout, the
    sweep); close it (or use it as a context manager) to remove the hooks and scratch files.
    """
    if state.tiers is not None:
        raise ValueError("this prompt state is already tiered; pass the original state")
    sources = {}
    for name in STREAMED_FIELDS:
        dense = getattr(state, name)
        if dense is not None:
            tier = _lower_tier(lower, tuple(dense.shape), dense.dtype, directory)
            for slot in range(dense.shape[0]):
                tier.write_from(slot, 0, dense[slot])
            sources[name] = (tier, tuple(dense.shape), dense.dtype)
    base = replace(state, **dict.fromkeys(sources))
    return tiered_from_sources(
        model,
        base,
        sources,
        budget_bytes=budget_bytes,
        lower=lower,
        directory=directory,
        exact=exact,
        chunk_tokens=chunk_tokens,
    )


def allocate_tiered_state(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    shard_tokens: int,
    budget: StateBudget,
    placement: Placement = WHOLE,
) -> TieredState:
    """An empty prompt state (this process's part of it at `placement`) whose per-token arrays
    live in `budget`'s lower tier from the start, so that a prefill writes each shard's rows
    straight there (`TieredArray.__setitem__`) and the state is never resident; the
    linear-attention checkpoints are allocated on the device as usual."""
    shapes = PrefixState.allocate(
        state_spec(model),
        prompt_ids=prompt_ids,
        shard_tokens=shard_tokens,
        placement=placement,
        dtype=next(model.parameters()).dtype,
        device="meta",
    )
    return tiered_like(model, shapes, budget)


def tiered_like(model: PreTrainedModel, shapes, budget: StateBudget) -> TieredState:
    """A tiered, zero state shaped like `shapes` (a whole state or a rank's slice allocated on
    the meta device): its per-token arrays new lower tiers, every other array zeros on the
    model's device."""
    device = next(iter(model.parameters())).device
    sources, resident = {}, {}
    for item in dataclasses.fields(shapes):
        meta = getattr(shapes, item.name)
        if not isinstance(meta, torch.Tensor) or meta.device.type != "meta":
            continue
        shape = tuple(meta.shape)
        if item.name in STREAMED_FIELDS:
            tier = _lower_tier(budget.lower, shape, meta.dtype, budget.directory)
            sources[item.name] = (tier, shape, meta.dtype)
        else:
            resident[item.name] = torch.zeros(shape, dtype=meta.dtype, device=device)
    base = replace(shapes, **dict.fromkeys(sources), **resident)
    return tiered_from_sources(
        model,
        base,
        sources,
        budget_bytes=budget.budget_bytes,
        lower=budget.lower,
        directory=budget.directory,
        exact=budget.exact,
    )


def tiered_from_sources(
    model: PreTrainedModel,
    base: PrefixState,
    sources: dict[str, tuple],
    *,
    budget_bytes: int,
    lower: str = "host",
    directory: str | None = None,
    exact: bool = True,
    chunk_tokens: int | None = None,
) -> TieredState:
    """A tiered state over prepared lower tiers: `sources` maps PrefixState field names
    (`STREAMED_FIELDS`) to (tier, [L, T, *X] shape, dtype); cotangents get new `lower` tiers.
    `chunk_tokens` (default: the model's kernel chunk, `prefix_chunk_tokens`) is the streamed
    unit; another grid than the kernels' still gives the same numbers, but a kernel slice across
    chunks is then gathered into a copy (and refused for a cotangent)."""
    if budget_bytes < 0:
        raise ValueError(
            f"state_budget_bytes must be >= 0 (or None: everything resident), got {budget_bytes}"
        )
    if chunk_tokens is None:
        chunk_tokens = prefix_chunk_tokens(model)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    device = next(iter(model.parameters())).device
    store = TieredStore(budget_bytes, device, chunk_tokens)
    fields = {}

    def add(name, tier, shape, dtype, writable, indices):
        store.arrays[name] = TieredArray(store, name, tier, shape, dtype, writable)
        row_bytes = store.arrays[name].row_bytes
        for slot, layer in enumerate(indices):
            store.layer_of[(name, slot)] = layer
            store.unit_bytes[layer] = store.unit_bytes.get(layer, 0) + shape[1] * row_bytes
        store.chunk_unit_bytes += min(chunk_tokens, shape[1]) * row_bytes
        return store.arrays[name]

    for name, (tier, shape, dtype) in sources.items():
        indices = array_layer_indices(base.spec, name)
        fields[name] = add(name, tier, shape, dtype, False, indices)
        if exact and STREAMED_FIELDS[name]:
            dtier = _lower_tier(lower, shape, torch.float32, directory)
            add(f"d{name}", dtier, shape, torch.float32, True, indices)
    # Whole layers kept for good, lowest first, leaving room for one streamed working chunk unit.
    order = sorted(store.unit_bytes)
    kept, used = [], 0
    for position, layer in enumerate(order):
        room = budget_bytes - (store.chunk_unit_bytes if position < len(order) - 1 else 0)
        if used + store.unit_bytes[layer] > room:
            break
        kept.append(layer)
        used += store.unit_bytes[layer]
    store.permanent = frozenset(kept)
    store.attach(model)
    tiered = TieredState(replace(base, **fields), store)
    tiered.state.tiers = tiered
    return tiered


@contextlib.contextmanager
def tiered_for_group(
    model: PreTrainedModel,
    state: PrefixState,
    budget_bytes: int | None,
    lower: str,
    directory: str | None,
    exact: bool,
) -> Iterator[PrefixState]:
    """`state` itself (no budget, or already tiered: its figures then count from here), or a
    tiered copy for the block's length."""
    if state.tiers is not None:
        state.tiers.store.start_counting()
        yield state
        return
    if budget_bytes is None:
        yield state
        return
    with tier_state(
        model, state, budget_bytes=budget_bytes, lower=lower, directory=directory, exact=exact
    ) as tiered:
        yield tiered.state
