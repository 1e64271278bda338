"""Resume exact mode's reverse sweep inside itself: what a sweep checkpoint holds, and the seam.

Once shards s .. S-1 are swept (and, on ranks, shard s's start-state cotangent handed back), the
rest of the sweep needs only:

- the cotangent dS of the positions before shard s (every branch and every later shard has
  added into it; the swept shards' own rows are never read again), on each rank its rows;
- the linear-attention cotangent carried into shard s - 1 (conv tail, recurrent state);
- the parameter gradient accumulated so far (replay and the swept shards): the whole fp32
  buffer on one process, a rank's rows on ranks;
- what replay recorded besides gradients (log-probs, losses, loss statistics), so a resumed
  backward does not replay again.

Continuing from those bits adds the same fp32 terms in the same order as the uninterrupted
sweep: the resumed gradient is bitwise the uninterrupted one. Where the checkpoints go is not
the engine's business: a `SweepCheckpoints` (the training layer's, over storage) says when one
is due, stores it, and finds the latest; the engine hands it `SweepTensor`s.

Legend: L layers of one kind, R rows of the positions before the next shard (this process's),
X one position's trailing dims.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from longstraw.engine.layer_kinds import COTANGENT_ARRAYS
from longstraw.grpo.losses import BranchStats


@dataclass(frozen=True)
class SweepTensor:
    """One tensor a sweep checkpoint holds, as its C-order fp32 elements (what storage's
    `FlatTensor` takes): `read(start, stop)` a 1-D CPU copy or view, `write(start, values)` sets
    them back."""

    name: str
    shape: tuple[int, ...]
    read: Callable[[int, int], torch.Tensor]
    write: Callable[[int, torch.Tensor], None]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class StoredSweep(Protocol):
    """A committed sweep checkpoint found for this backward."""

    swept: int
    """Shards swept before it: the sweep continues at shard `num_shards - 1 - swept`."""
    record: dict
    """`record_json` of the replay."""

    def read_into(self, tensors: list[SweepTensor]) -> bool:
        """Restore `tensors`; False where it cannot (a damaged chunk, named in one line): the
        tensors are then partly written and the sweep starts over."""


class SweepCheckpoints(Protocol):
    """Where a reverse sweep keeps its progress. Every process of the group calls each method at
    the same point of the sweep, with its own tensors; the answers agree across them."""

    def latest(self) -> StoredSweep | None:
        """The latest committed checkpoint of this backward (None: start the sweep over; a
        checkpoint of other inputs is named in one line)."""

    def due(self, swept: int) -> bool:
        """Whether to commit one now that `swept` shards are swept."""

    def save(self, swept: int, tensors: list[SweepTensor], record: dict) -> None:
        """Commit the rest of the sweep's needs after `swept` shards."""


def resident_tensor(name: str, tensor: torch.Tensor) -> SweepTensor:
    """A contiguous fp32 tensor (any device) seen flat."""
    assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
    flat = tensor.view(-1)

    def read(start: int, stop: int) -> torch.Tensor:
        return flat[start:stop].cpu()

    def write(start: int, values: torch.Tensor) -> None:
        flat[start : start + values.numel()].copy_(values)

    return SweepTensor(name, tuple(tensor.shape), read, write)


def tiered_rows(name: str, array, slot: int, rows: int) -> SweepTensor:
    """Rows [0, rows) of slot `slot` of a cotangent kept in a lower tier
    (`engine.state_tiers.TieredArray`), seen flat: read a few rows at a time, written back one
    streamed chunk at a time (the grid the tier adds into)."""
    row = math.prod(array.shape[2:])
    grid = array.store.chunk_tokens

    def span(start: int, stop: int) -> tuple[int, int]:
        return start // row, -(-stop // row)

    def read(start: int, stop: int) -> torch.Tensor:
        first, last = span(start, stop)
        block = array.read(slot, first, last).reshape(-1)
        return block[start - first * row : stop - first * row].cpu()

    def write(start: int, values: torch.Tensor) -> None:
        first, last = span(start, start + values.numel())
        block = array.read(slot, first, last)
        flat = block.view(-1)
        flat[start - first * row : start - first * row + values.numel()] = values
        held = array[slot]  # the resident layer's rows, or streamed rows chunk by chunk
        lo = first
        while lo < last:
            hi = min(last, (lo // grid + 1) * grid)
            held[lo:hi] = block[lo - first : hi - first].to(array.device)
            lo = hi

    return SweepTensor(name, (rows, *array.shape[2:]), read, write)


def rows_before(state, shard: int) -> int:
    """This process's rows of the positions before shard `shard` + 1, i.e. up to the end of
    `shard`: what the sweep of shards `shard` .. 0 still reads of dS."""
    end = state.bounds[shard][1]
    return max(0, min(end, state.token_end) - state.token_start)


def sweep_tensors(state, cotangent, accumulator, next_shard: int) -> list[SweepTensor]:
    """Everything this process's part of the sweep of shards `next_shard` .. 0 needs (module
    docstring), in a fixed order: dS rows per array and slot, the linear-attention cotangents,
    the gradient accumulator by parameter name."""
    rows = rows_before(state, next_shard)
    out = []
    for array in COTANGENT_ARRAYS:
        held = getattr(cotangent, array.field)
        if held is None:
            continue
        if not array.per_token:
            out.append(resident_tensor(f"cotangent/{array.field}", held))
            continue
        for slot in range(held.shape[0]):
            name = f"cotangent/{array.field}/{slot}"
            if hasattr(held, "read"):
                out.append(tiered_rows(name, held, slot, rows))
            else:
                out.append(resident_tensor(name, held[slot, :rows]))
    for name in sorted(accumulator.grads):
        grad = accumulator.grads[name]
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        out.append(resident_tensor(f"grad/{name}", local))
    return out


def zero_tensors(tensors: list[SweepTensor]) -> None:
    """Every element of `tensors` zero again (a restore that failed midway)."""
    for tensor in tensors:
        tensor.write(0, torch.zeros(tensor.numel, dtype=torch.float32))


# --- what replay recorded -----------------------------------------------------------------------


def _number(value: torch.Tensor | None):
    return None if value is None else [float(value), str(value.dtype).removeprefix("torch.")]


def _tensor(value) -> torch.Tensor | None:
    return None if value is None else torch.tensor(value[0], dtype=getattr(torch, value[1]))


def record_json(record) -> dict:
    """The parts of a `ReplayRecord` a resumed sweep reports (JSON: every number exact —
    Python floats hold fp32 values exactly)."""
    return {
        "logprobs": [logp.cpu().tolist() for logp in record.logprobs],
        "losses": list(record.losses),
        "stats": [{f.name: _number(getattr(s, f.name)) for f in fields(s)} for s in record.stats],
        "replay_seconds": record.seconds.get("replay", 0.0),
    }


def record_parts(data: dict) -> tuple[list[torch.Tensor], list[float], list[BranchStats]]:
    """(log-probs [G][R_i] fp32, losses [G], loss statistics [G]) of a `record_json`."""
    logprobs = [torch.tensor(lp, dtype=torch.float32) for lp in data["logprobs"]]
    stats = [BranchStats(**{k: _tensor(v) for k, v in s.items()}) for s in data["stats"]]
    return logprobs, list(data["losses"]), stats
