"""fp32 gradient accumulators sharded over the sequence group: each rank keeps dim-0 slices.

Legend: d0 a parameter's dim 0, N_d data ranks, N_s sequence ranks, W = N_d · N_s, c = the
FSDP chunk ceil(d0 / W).

Layout (`SliceLayout`). FSDP2 shards a parameter over the flattened ("data", "seq") mesh in
`torch.chunk` pieces of dim 0: global rank g = d · N_s + s holds chunk g, rows
[g·c, (g+1)·c) clipped to d0 (possibly empty). Before the data-parallel average, sequence rank s
of every replica accumulates the chunks d' · N_s + s for ALL d' (its replica's gradient on the
rows that data ranks (·, s) will own): N_d pieces, about d0 / N_s rows, kept packed in piece
order. An all_reduce (gloo) or reduce_scatter (NCCL) of that packed slice over "data" then
leaves piece d on rank (d, s) — exactly the local shard of FSDP's DTensor `.grad`. With
N_d = 1 the slice is the contiguous `torch.chunk(param, N_s)[s]`.

Accumulation (`sliced_gradient`, the `gradient_sink` of `CrossRankExchange`):

* branch replay (replicated, identical gradient on every rank): each parameter's post-accumulate
  hook adds this rank's rows to its slice and drops `.grad` — no communication, and the branch is
  counted once because the slices partition the rows (`slices_drained_into`).
* reverse sweep (shard s's parameter gradient exists only on its owner): the owner's hook
  announces the parameter with an `OP_GRADIENT_SLICES` header (the owner/serve protocol of
  `cross_rank_attention`: the servers follow the header, so autograd's order needs no
  prediction) and scatters the other ranks' rows to them; everyone adds its rows to its slice
  (`slices_scattered_from_owner`, `receive_gradient_slices`).

At no point does a rank hold a dense fp32 accumulator: the only dense tensor is the `.grad` of
the parameter autograd is accumulating (and, on a sweep owner, its packed copy for the scatter).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from longstraw.distributed.cross_rank_attention import announce_gradient_slices
from longstraw.distributed.topology import Topology
from longstraw.engine.gradient_sink import GradientSink, grads_consumed_by, trainable_parameters


@dataclasses.dataclass(frozen=True)
class SliceLayout:
    """Which dim-0 rows of every parameter this sequence rank accumulates (module docstring)."""

    seq_rank: int
    """This rank's index in its sequence group."""
    seq_size: int
    """N_s: ranks in the sequence group."""
    data_size: int = 1
    """N_d: data replicas the slices will later be averaged over (FSDP over data × seq)."""

    @classmethod
    def of(cls, topology: Topology) -> SliceLayout:
        """The rows this rank of `topology` accumulates: its sequence index's chunk of every
        replica."""
        return cls(topology.sequence_rank, topology.sequence_ranks, topology.replicas)

    @property
    def topology(self) -> Topology:
        """The data × seq ranks the rows are laid out over, seen from this sequence rank of
        replica 0 (every replica's rank s holds the same rows)."""
        return Topology(self.data_size * self.seq_size, self.data_size, self.seq_rank)

    def pieces(self, dim0: int, seq_rank: int | None = None) -> list[tuple[int, int]]:
        """[N_d] (start, end) row ranges of `seq_rank` (default: this rank), in data order."""
        s = self.seq_rank if seq_rank is None else seq_rank
        topology = self.topology
        chunk = -(-dim0 // topology.world_size)
        return [(min(g * chunk, dim0), min((g + 1) * chunk, dim0)) for g in topology.data_ranks(s)]

    def rows(self, dim0: int, seq_rank: int | None = None) -> int:
        return sum(end - start for start, end in self.pieces(dim0, seq_rank))

    def padded_rows(self, dim0: int) -> int:
        """The most rows any sequence rank holds: the size every rank's scatter part gets."""
        return self.data_size * -(-dim0 // self.topology.world_size)


def _packed(full: torch.Tensor, pieces: list[tuple[int, int]], rows: int | None = None):
    """The rows of `pieces` of `full` stacked in order, padded to `rows` if given (the padding
    is uninitialised: a receiver keeps only its own row count)."""
    parts = [full[start:end] for start, end in pieces if end > start]
    used = sum(p.shape[0] for p in parts)
    if rows is not None and rows > used:
        parts.append(full.new_empty((rows - used, *full.shape[1:])))
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return full.new_empty((0, *full.shape[1:]))
    return torch.cat(parts)


class GradSlices:
    """This rank's fp32 slices of each trainable parameter's gradient (by name, `SliceLayout`).

    `grads[name]` is [rows, *param.shape[1:]]: the pieces of `layout.pieces(param.shape[0])`
    stacked in data order. `bytes_sent` / `bytes_received` count the sweep's scatter payloads.
    """

    def __init__(self, model: PreTrainedModel, layout: SliceLayout):
        self.layout = layout
        params = trainable_parameters(model)
        for name, p in params:
            if p.dim() == 0:
                raise ValueError(f"parameter {name} is 0-dimensional; slices are dim-0 rows")
        self.pieces = {name: layout.pieces(p.shape[0]) for name, p in params}
        self.grads: dict[str, torch.Tensor] = {
            name: torch.zeros(
                (layout.rows(p.shape[0]), *p.shape[1:]), dtype=torch.float32, device=p.device
            )
            for name, p in params
        }
        self.dtypes = {name: p.dtype for name, p in params}
        self.bytes_sent = 0
        self.bytes_received = 0

    def nbytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grads.values())

    def add_rows_of(self, name: str, full: torch.Tensor) -> None:
        """Add this rank's rows of the dense gradient `full` (any dtype) to its slice."""
        slice_ = self.grads[name]
        if slice_.shape[0]:
            slice_ += _packed(full, self.pieces[name]).float()

    def rows_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a dense tensor shaped like the parameter (for comparisons)."""
        return _packed(full, self.pieces[name])


@contextlib.contextmanager
def slices_drained_into(
    params: list[tuple[str, torch.nn.Parameter]], slices: GradSlices
) -> Iterator[None]:
    """Inside the block each parameter's gradient, once autograd has accumulated it, adds this
    rank's rows to `slices` and `.grad` is dropped (replicated branch replay: no traffic)."""
    with grads_consumed_by(params, lambda index, name, grad: slices.add_rows_of(name, grad)):
        yield


def _scatter_parts(
    slices: GradSlices, name: str, dim0: int, full: torch.Tensor | None, owner: int, group
) -> torch.Tensor:
    """The owner's rows for every rank, padded to one size (`padded_rows`), scattered; returns
    this rank's part (its first `layout.rows` rows are its own, the rest is padding)."""
    layout = slices.layout
    rows = layout.padded_rows(dim0)
    shape = (rows, *slices.grads[name].shape[1:])
    me = dist.get_rank(group)
    parts = None
    if me == owner:
        assert full is not None
        parts = [
            _packed(full, layout.pieces(dim0, r), rows).contiguous() for r in range(layout.seq_size)
        ]
        received = parts[me]
        slices.bytes_sent += sum(
            p.numel() * p.element_size() for i, p in enumerate(parts) if i != me
        )
    else:
        received = torch.empty(shape, dtype=slices.dtypes[name], device=slices.grads[name].device)
        slices.bytes_received += received.numel() * received.element_size()
    dist.scatter(received, parts, group=group, group_src=owner)
    return received


@contextlib.contextmanager
def slices_scattered_from_owner(
    params: list[tuple[str, torch.nn.Parameter]], slices: GradSlices, *, group
) -> Iterator[None]:
    """Sweep owner side: each parameter's accumulated gradient is announced to the serving ranks
    (`OP_GRADIENT_SLICES`, the parameter's index) and scattered; every rank keeps its rows.

    Active only while this rank runs a backward, i.e. while it owns the shard being swept: the
    other ranks are then inside `serve_owner` and answer with `receive_gradient_slices`.
    """
    me = dist.get_rank(group)

    def scatter(index: int, name: str, grad: torch.Tensor) -> None:
        announce_gradient_slices(index, me, group)
        mine = _scatter_parts(slices, name, grad.shape[0], grad, me, group)
        rows = slices.grads[name].shape[0]
        slices.grads[name] += mine[:rows].float()

    with grads_consumed_by(params, scatter):
        yield


def receive_gradient_slices(
    params: list[tuple[str, torch.nn.Parameter]], slices: GradSlices, *, group
) -> Callable[[int, int], None]:
    """Serving side of `slices_scattered_from_owner`: `(owner, index)` -> receive and add."""

    def receive(owner: int, index: int) -> None:
        name, p = params[index]
        mine = _scatter_parts(slices, name, p.shape[0], None, owner, group)
        rows = slices.grads[name].shape[0]
        slices.grads[name] += mine[:rows].float()

    return receive


def sliced_gradient(
    model: PreTrainedModel, *, group: dist.ProcessGroup | None, ranks: Topology
) -> GradientSink:
    """A rank's gradient sink: its dim-0 rows of the gradient (`SliceLayout.of(ranks)`, laid
    out for the replicas they will be summed over); branch replay (the same on every rank) adds
    its rows, the sweep's gradient of a shard is scattered from its owner."""
    params, slices = trainable_parameters(model), GradSlices(model, SliceLayout.of(ranks))
    return GradientSink(
        slices,
        replay=slices_drained_into(params, slices),
        sweep=slices_scattered_from_owner(params, slices, group=group),
        on_gradient_slices=receive_gradient_slices(params, slices, group=group),
    )
