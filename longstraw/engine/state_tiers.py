"""Prompt state beyond the compute device: a resident budget, the rest streamed layer by layer.

Legend: L layers of one kind, T state tokens, X the trailing dims of one position (K×D, R, ...).

A tiered state keeps every per-token array (full-attention K/V, MLA latents, rope and indexer
keys) and, in exact mode, their fp32 cotangent dS in a lower tier — host memory (`HostTier`) or
a local scratch file (`FileTier`) — and gives the cache layers *placeholders*: tensors of the
right shape whose storage is empty until the model reaches their layer. A forward pre-hook on
each decoder layer fills that layer's placeholders (and frees the previous streamed layer's); a
hook on the layer's output fills them again just before the layer's backward, cotangents
included, and a freed cotangent is written back to the lower tier (read-modify-write in fp32).
The next streamed layer in the direction of travel is prefetched on a background thread while
the current one computes.

Layers whose state fits are kept resident for good (lowest layer index first), leaving room in
the budget for one streamed working layer; the prefetch buffer is the one allowance above it.
Resident bytes are counted by the store itself (on CPU "device" and "host" are one memory), and
peak resident ≤ max(budget, one layer) + one layer: the unit is a whole layer, never a chunk of
one. Linear-attention checkpoints are constant-size host tensors and stay as they are.

The kernels read the same values in the same order as a fully resident state: log-probs,
rollout tokens and gradients are bitwise equal (tests/engine/test_state_tiers.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel

from longstraw.engine.state import PrefixState
from longstraw.models.adapters import decoder_of

# PrefixState fields that grow with the prompt, and whether exact mode keeps a cotangent of them.
STREAMED_FIELDS = {
    "keys": True,
    "values": True,
    "latent": True,
    "rope_key": True,
    "indexer_key": False,
}


class HostTier:
    """The lower tier in host memory: one [L, T, *X] tensor (pinned when CUDA is present)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self.tensor = torch.zeros(shape, dtype=dtype, pin_memory=torch.cuda.is_available())

    def read_into(self, slot: int, start: int, out: torch.Tensor) -> None:
        out.copy_(self.tensor[slot, start : start + out.shape[0]])

    def write_from(self, slot: int, start: int, src: torch.Tensor) -> None:
        self.tensor[slot, start : start + src.shape[0]].copy_(src)

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


@dataclass(eq=False)
class _Buffer:
    """The device copy of one slot of one array: [T, *X], its storage empty when not resident.

    Cache layers get views of it (`[:end]`): views stay valid while the storage is emptied and
    refilled, so a graph built on them reads whatever is resident when its backward runs.
    """

    tensor: torch.Tensor
    array: TieredArray
    slot: int
    resident: bool = False
    dirty: bool = False

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class TieredArray:
    """An [L, T, *X] array whose truth is in a lower tier; indexing hands out placeholders.

    `array[slot]` and `array[slot, :end]` (what the cache layers take) return [end, *X] device
    tensors that the store fills while their layer runs; `read(slot, start, end)` copies a slice
    out of the lower tier (what the sweep checks and seeds with).
    """

    def __init__(self, store: TieredStore, name: str, tier, shape, dtype, writable: bool):
        self.store, self.name, self.tier = store, name, tier
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = store.device
        self.writable = writable
        self.row_numel = 1
        for size in shape[2:]:
            self.row_numel *= size

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def __getitem__(self, key) -> torch.Tensor:
        slot, end = (key, self.shape[1]) if isinstance(key, int) else key
        if isinstance(end, slice):
            if end.start not in (None, 0) or end.step not in (None, 1):
                raise IndexError(f"{self.name}: placeholders cover [:end]; use read() for slices")
            end = self.shape[1] if end.stop is None else min(end.stop, self.shape[1])
        return self.store.placeholder(self, int(slot), int(end))

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """[end - start, *X] copy of the slice from the lower tier (pending writes flushed)."""
        self.store.flush_slot(self, slot)
        out = torch.empty((end - start, *self.shape[2:]), dtype=self.dtype, device=self.device)
        self.tier.read_into(slot, start, out)
        return out


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A second tensor over the same storage with its own version counter: filling through it
    leaves the placeholder's `_version` alone (the prefix attention checks that nobody wrote
    into the prompt state between its forward and backward; a refill is no such write)."""
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage(), 0, tensor.shape, tensor.stride()
    )


@dataclass
class TieredStore:
    """The placeholders of one tiered state, the budget, and the hooks that stream them."""

    budget_bytes: int
    device: torch.device
    unit_bytes: dict[int, int] = field(default_factory=dict)
    """Bytes per model layer: its state, plus its cotangent in exact mode."""
    permanent: frozenset[int] = frozenset()
    """Model layers kept resident for good."""
    arrays: dict[str, TieredArray] = field(default_factory=dict)
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    prefetches: int = 0
    """Layers read on the background thread ahead of their use."""

    def __post_init__(self):
        self._buffers: dict[tuple[str, int], _Buffer] = {}
        self._by_layer: dict[int, list[_Buffer]] = {}
        self._layer_of: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        self._working: int | None = None
        self._pending: tuple[int, Future] | None = None
        self._prefetched: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="longstraw-prefetch")
        self._handles: list = []
        self._order: list[int] = []

    # -- placeholders -------------------------------------------------------------------------

    def placeholder(self, array: TieredArray, slot: int, end: int) -> torch.Tensor:
        """[end, *X] view of the device buffer of `array[slot]`, filled while its layer runs."""
        # A prefetch in flight may be filling this very buffer: let it finish first.
        self._settle()
        layer = self._layer_of[(array.name, slot)]
        key = (array.name, slot)
        buffer = self._buffers.get(key)
        if buffer is None:
            tensor = torch.empty(array.shape[1:], dtype=array.dtype, device=self.device)
            tensor.untyped_storage().resize_(0)
            buffer = self._buffers[key] = _Buffer(tensor, array, slot)
            self._by_layer.setdefault(layer, []).append(buffer)
        storage = buffer.tensor.untyped_storage()
        if buffer.resident:
            return buffer.tensor[:end]
        # A view cannot be cut from an empty storage: size it for the cut (allocated, never
        # touched or counted), then empty it again.
        storage.resize_(buffer.nbytes)
        view = buffer.tensor[:end]
        storage.resize_(0)
        if layer in self.permanent or layer in (self._working, self._prefetched):
            self._fill(buffer, backward=False)
        return view

    def _entries(self, layer: int) -> list[_Buffer]:
        return list(self._by_layer.get(layer, []))

    def _fill(self, buffer: _Buffer, *, backward: bool) -> None:
        if buffer.array.writable and not backward and not buffer.resident:
            return  # a cotangent is only read and written by the backward
        if not buffer.resident:
            buffer.tensor.untyped_storage().resize_(buffer.nbytes)
            buffer.array.tier.read_into(buffer.slot, 0, _alias(buffer.tensor))
            with self._lock:
                buffer.resident = True
                self.resident_bytes += buffer.nbytes
                self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
                self.bytes_read += buffer.nbytes
        if backward and buffer.array.writable:
            buffer.dirty = True

    def _write_back(self, buffer: _Buffer) -> None:
        if buffer.dirty:
            buffer.array.tier.write_from(buffer.slot, 0, buffer.tensor)
            buffer.dirty = False
            with self._lock:
                self.bytes_written += buffer.nbytes

    def _release(self, layer: int) -> None:
        for buffer in self._entries(layer):
            if not buffer.resident:
                continue
            self._write_back(buffer)
            buffer.tensor.untyped_storage().resize_(0)
            with self._lock:
                buffer.resident = False
                self.resident_bytes -= buffer.nbytes

    def flush_slot(self, array: TieredArray, slot: int) -> None:
        """Write back what the backward added into `array[slot]` and is still on the device."""
        self._settle()
        buffer = self._buffers.get((array.name, slot))
        if buffer is not None and buffer.resident:
            self._write_back(buffer)

    # -- streaming ----------------------------------------------------------------------------

    def _settle(self) -> None:
        """Wait for the prefetch in flight; its layer stays resident as `_prefetched`."""
        if self._pending is not None:
            self._prefetched, future = self._pending
            self._pending = None
            future.result()

    def acquire(self, layer: int, *, backward: bool) -> None:
        """Make `layer`'s placeholders resident (cotangents too when `backward`), free the
        previous streamed layer, and start prefetching the next one in this direction."""
        if layer not in self.unit_bytes:
            return
        self._settle()
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched != layer and prefetched not in self.permanent:
            self._release(prefetched)
        if self._working is not None and self._working != layer:
            self._release(self._working)
        self._working = None if layer in self.permanent else layer
        for entry in self._entries(layer):
            self._fill(entry, backward=backward)
        position = self._order.index(layer)
        ahead = self._order[:position][::-1] if backward else self._order[position + 1 :]
        following = [candidate for candidate in ahead if candidate not in self.permanent]
        if following:
            nxt = following[0]
            entries = self._entries(nxt)
            self.prefetches += 1
            self._pending = (
                nxt,
                self._pool.submit(lambda: [self._fill(e, backward=backward) for e in entries]),
            )

    def release_all(self) -> None:
        """Write back and free every streamed layer (the permanent ones are kept)."""
        self._settle()
        for layer in {self._prefetched, self._working} - {None}:
            if layer not in self.permanent:
                self._release(layer)
        self._working = self._prefetched = None

    def attach(self, model: PreTrainedModel) -> None:
        """Hook every decoder layer of `model`: fill before its forward and before its backward."""

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
        """Remove the hooks, stop the prefetcher and delete the lower tier's scratch files."""
        self.release_all()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pool.shutdown(wait=True)
        for array in self.arrays.values():
            array.tier.close()


def _layer_indices(state: PrefixState, name: str) -> tuple[int, ...]:
    spec = state.spec
    if name in ("keys", "values"):
        return spec.full_attention.layer_indices
    if name == "indexer_key":
        return spec.mla.indexer_layer_indices
    return spec.mla.layer_indices


class TieredState:
    """A `PrefixState` whose per-token arrays live in a lower tier (`tier_state`)."""

    def __init__(self, state: PrefixState, store: TieredStore):
        self.state = state
        self.store = store

    def cotangent(self):
        """A zero `PromptCotangent` whose per-token parts live in the lower tier too."""
        from longstraw.engine.replay import PromptCotangent

        plain = replace(self.state, keys=None, values=None, latent=None, rope_key=None)
        dense = PromptCotangent.zeros_like_state(replace(plain, tiers=None))
        parts = {
            name: self.store.arrays.get(f"d{name}")
            for name in ("keys", "values", "latent", "rope_key")
        }
        return replace(dense, **parts)

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
) -> TieredState:
    """Move `state`'s per-token arrays into the `lower` tier ("host" or "disk": a scratch file in
    `directory`) and stream them through `model` under `budget_bytes` of device memory.

    `exact` keeps each layer's fp32 cotangent in the same lower tier and counts it in the
    budget. The returned `TieredState.state` replaces `state` everywhere (replay, rollout, the
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
) -> TieredState:
    """A tiered state over prepared lower tiers: `sources` maps PrefixState field names
    (`STREAMED_FIELDS`) to (tier, [L, T, *X] shape, dtype); cotangents get new `lower` tiers."""
    if budget_bytes < 0:
        raise ValueError(
            f"state_budget_bytes must be >= 0 (or None: everything resident), got {budget_bytes}"
        )
    device = next(iter(model.parameters())).device
    store = TieredStore(budget_bytes, device)
    fields = {}
    for name, (tier, shape, dtype) in sources.items():
        indices = _layer_indices(base, name)
        fields[name] = TieredArray(store, name, tier, shape, dtype, writable=False)
        store.arrays[name] = fields[name]
        slot_bytes = torch.Size(shape[1:]).numel() * dtype.itemsize
        for slot, layer in enumerate(indices):
            store._layer_of[(name, slot)] = layer
            store.unit_bytes[layer] = store.unit_bytes.get(layer, 0) + slot_bytes
        if exact and STREAMED_FIELDS[name]:
            dname = f"d{name}"
            dtier = _lower_tier(lower, shape, torch.float32, directory)
            store.arrays[dname] = TieredArray(
                store, dname, dtier, shape, torch.float32, writable=True
            )
            for slot, layer in enumerate(indices):
                store._layer_of[(dname, slot)] = layer
                store.unit_bytes[layer] += torch.Size(shape[1:]).numel() * 4
    store._order = sorted(store.unit_bytes)
    # Permanent residents, lowest layer first, leaving room for one streamed working layer.
    reserve = max(store.unit_bytes.values(), default=0)
    kept, used = [], 0
    for layer in store._order:
        remaining = len(store._order) - len(kept) - 1
        room = budget_bytes - (reserve if remaining > 0 else 0)
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
    """`state` itself (no budget, or already tiered), or a tiered copy for the block's length."""
    if budget_bytes is None or state.tiers is not None:
        yield state
        return
    with tier_state(
        model, state, budget_bytes=budget_bytes, lower=lower, directory=directory, exact=exact
    ) as tiered:
        yield tiered.state
