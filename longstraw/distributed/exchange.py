"""The ranks' `PrefixExchange` (`longstraw.engine.exchange`): a branch reads the prompt prefix
across its sequence group.

Replicated, as every branch on the ranks runs: each rank runs the same branch on the same inputs
over its part of the `PrefixState`; the attention op, given the ranks that hold the rest of the
prompt (`cross_rank_attention`, `cross_rank_mla`), merges every rank's partial over its
positions, so the branch's outputs are the same bits on every rank and each rank's prompt
cotangent collects dK/dV for its positions only. The parts: each attention layer's ranks
(`layer_placement`), the shards this rank holds and the protocol around the others
(`shard_ownership`), what the ranks agree on (`collectives`), and this rank's rows of the
gradient (`gradient_slices.sliced_gradient`).
"""

from __future__ import annotations

import functools

import torch.distributed as dist

from longstraw.distributed.collectives import CrossRankCollectives
from longstraw.distributed.gradient_slices import sliced_gradient
from longstraw.distributed.layer_placement import CrossRankLayers
from longstraw.distributed.shard_ownership import CrossRankShards
from longstraw.distributed.topology import Topology
from longstraw.engine.exchange import PrefixExchange


class CrossRankExchange(PrefixExchange):
    """The prompt state is split over the ranks of `group` (None: the default group).

    `control` carries the Python objects `on_leader` hands out (a gloo group where `group` is
    NCCL; None: `group` itself). `topology`: the run's ranks, `group` being this rank's
    replica's sequence group (None: `group` is the whole run, one replica). Call where the group
    exists (on every rank of it)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        control: dist.ProcessGroup | None = None,
        topology: Topology | None = None,
    ):
        if topology is None:
            topology = Topology(dist.get_world_size(group), 1, dist.get_rank(group))
        super().__init__(
            layers=CrossRankLayers(group),
            shards=CrossRankShards(topology, group),
            collectives=CrossRankCollectives(group, control),
            gradient_sink=functools.partial(sliced_gradient, group=group, ranks=topology),
        )
