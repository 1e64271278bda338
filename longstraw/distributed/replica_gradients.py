"""A step's gradient summed across data-parallel replicas, straight into the FSDP shards.

Legend: R replicas of S sequence ranks, global rank g = d · S + s, d0 a parameter's dim 0,
c = ceil(d0 / (R · S)) the FSDP chunk.

Each replica sums the contributions of the groups it ran. Sequence rank s of replica d then holds
the rows of chunks {d' · S + s : every d'} of that sum (`gradient_slices.SliceLayout.of(topology)`;
with S = 1 the whole gradient). One reduce-scatter over the ranks with the same s (the "data"
group) adds the replicas' sums and leaves chunk d · S + s — rank g's FSDP shard — on rank g: each
rank sends and receives (R − 1) / R of its slice, never the dense gradient. The normalisers that
span groups were fixed for the whole step before any replay, so this sum is the step's gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from longstraw.distributed.gradient_slices import GradSlices, SliceLayout
from longstraw.distributed.topology import Topology

TRAFFIC = {"bytes": 0}
"""Bytes this process handed to the replicas' reduce-scatter (what the benchmark reports)."""


def zero_replica_rows(
    model: PreTrainedModel, topology: Topology, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """Zeros shaped like this rank's rows of each trainable parameter before the replicas' sum
    (a replica that ran no group of the step still takes part in it)."""
    grads = GradSlices(model, SliceLayout.of(topology)).grads
    return {name: g.to(device) for name, g in grads.items()}


def sum_over_replicas(
    model: PreTrainedModel,
    grads: dict[str, torch.Tensor],
    topology: Topology,
    data_group: dist.ProcessGroup,
) -> dict[str, torch.Tensor]:
    """`grads` (this replica's sum: [rows of `SliceLayout.of(topology)`, *param.shape[1:]] by
    name) added across the replicas; returns this rank's FSDP shard of each ([chunk rows, ...]).

    Collective over `data_group`: every rank of the run calls it once per step, with the same
    names (taken in the model's order)."""
    replicas, layout = topology.replicas, SliceLayout.of(topology)
    shapes = {name: p.shape for name, p in model.named_parameters() if name in grads}
    out = {}
    # In the model's order on every rank: `grads` is in the order its source gave (a gradient
    # file read back, or one this process computed), which may differ between two ranks.
    for name in shapes:
        part = grads[name]
        dim0, rest = shapes[name][0], tuple(shapes[name][1:])
        chunk = -(-dim0 // topology.world_size)
        pieces = layout.pieces(dim0)
        # Each replica's piece padded to one chunk: the reduce-scatter splits evenly.
        padded = part.new_zeros((replicas * chunk, *rest))
        offset = 0
        for d, (start, end) in enumerate(pieces):
            rows = end - start
            padded[d * chunk : d * chunk + rows] = part[offset : offset + rows]
            offset += rows
        assert offset == part.shape[0], (name, offset, part.shape)
        mine = part.new_empty((chunk, *rest))
        dist.reduce_scatter_single(mine, padded, group=data_group)
        TRAFFIC["bytes"] += padded.numel() * padded.element_size()
        start, end = pieces[topology.replica]
        out[name] = mine[: end - start].clone()
    return out
