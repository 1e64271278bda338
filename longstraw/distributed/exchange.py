"""The ranks' `PrefixExchange` (`longstraw.engine.exchange`): a branch reads the prompt prefix
across its sequence group.

Replicated, as every branch on the ranks runs: each rank runs the same branch on the same inputs
over its part of the `PrefixState`; the cross-rank attention (`cross_rank_attention`,
`cross_rank_mla`) merges every rank's partial over its positions, so the branch's outputs are the
same bits on every rank and each rank's prompt cotangent collects dK/dV for its positions only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from longstraw.distributed.cross_rank_attention import (
    COMM,
    CrossRankAttentionLayer,
    cross_rank_attention_enabled,
    finish_owner,
)
from longstraw.distributed.cross_rank_mla import CrossRankMlaLayer, CrossRankSegmentMlaLayer
from longstraw.distributed.gradient_slices import (
    GradSlices,
    SliceLayout,
    receive_gradient_slices,
    slices_drained_into,
    slices_scattered_from_owner,
)
from longstraw.distributed.topology import Topology
from longstraw.engine.exchange import PrefixExchange
from longstraw.engine.group import GradientSink, trainable_parameters
from longstraw.engine.layer_kinds import CHECKPOINT_ARRAYS
from longstraw.engine.state import Placement


def owner_kind_kwargs(
    state, shard: int, group, *, mla_layer_class: type[CrossRankMlaLayer] = CrossRankMlaLayer
) -> dict:
    """Each kind's cache layer on the rank that holds `shard` and computes it (prefill) or
    recomputes it (sweep) while the other ranks serve their prefix (owner mode)."""
    ranks = {"group": group, "owner": state.rank}
    return {
        "full_attention": lambda slot: {
            "layer_class": CrossRankAttentionLayer,
            "slot": slot,
            **ranks,
        },
        "mla": {
            "layer_class": mla_layer_class,
            "num_prefix": state.bounds[shard][0],
            "local_start": state.token_start,
            **ranks,
        },
    }


def cross_rank_kind_kwargs(state, group, **attention) -> dict:
    """Each kind's replicated cross-rank cache layer over `state` (this rank's slice), for
    `layer_kinds.branch_layers`; `attention` adds arguments of the attention kinds' layers
    (`keep_branch` when decoding)."""
    ranks = {"group": group, "owner": None, **attention}
    return {
        "full_attention": {"layer_class": CrossRankAttentionLayer, **ranks},
        "mla": {
            "layer_class": CrossRankMlaLayer,
            "num_prefix": state.num_tokens,
            "local_start": state.token_start,
            **ranks,
        },
    }


class ReplicaDivergenceError(RuntimeError):
    """Ranks of the sequence group drew different tokens in a replicated decode step."""


@dataclass(frozen=True)
class CrossRankExchange(PrefixExchange):
    """The prompt state is split over the ranks of `group` (None: the default group).

    `control` carries the Python objects `on_leader` hands out (a gloo group where `group` is
    NCCL; None: `group` itself). `topology`: the run's ranks, `group` being this rank's
    replica's sequence group (None: `group` is the whole run, one replica)."""

    group: dist.ProcessGroup | None = None
    control: dist.ProcessGroup | None = None
    topology: Topology | None = None

    @property
    def ranks(self) -> Topology:
        """The run's ranks from this one (`topology`, or one replica of `group`'s ranks)."""
        if self.topology is not None:
            return self.topology
        return Topology(dist.get_world_size(self.group), 1, dist.get_rank(self.group))

    def attention_enabled(self, model: PreTrainedModel) -> contextlib.AbstractContextManager:
        return cross_rank_attention_enabled(model)

    def segment_kind_kwargs(self, state) -> dict:
        kinds = cross_rank_kind_kwargs(state, self.group)
        return {
            "full_attention": kinds["full_attention"],
            "mla": kinds["mla"] | {"layer_class": CrossRankSegmentMlaLayer},
        }

    def branch_kind_kwargs(self, state, *, keep_branch: bool, branch_capacity: int) -> dict:
        # The cross-rank layers grow their kept K/V step by step: no capacity to preallocate.
        del branch_capacity
        return cross_rank_kind_kwargs(state, self.group, keep_branch=keep_branch)

    def check_draws(self, choice_G1: torch.Tensor, step: int) -> None:
        """Every rank drew the same G tokens at this step (else raise on every rank): a rank
        that drew otherwise would leave the others blocked in a collective or silently train on
        other responses. 8·G bytes per rank and step."""
        draws = choice_G1.reshape(-1).to(torch.int64).contiguous()
        parts = [torch.empty_like(draws) for _ in range(dist.get_world_size(self.group))]
        COMM.add(draws)
        dist.all_gather(parts, draws, group=self.group)
        differ = [rank for rank, part in enumerate(parts) if not torch.equal(part, parts[0])]
        if differ:
            raise ReplicaDivergenceError(
                f"decode step {step}: ranks {differ} drew {[parts[r].tolist() for r in differ]}, "
                f"rank 0 drew {parts[0].tolist()}; seed every rank's generator identically and "
                "use the same model weights, dtype and sampling parameters on every rank"
            )

    def gradient_sink(self, model: PreTrainedModel) -> GradientSink:
        """This rank's dim-0 rows of the gradient (`gradient_slices`, laid out for the replicas
        they will be summed over): branch replay (the same on every rank) adds its rows, the
        sweep's gradient of a shard is scattered from its owner."""
        params = trainable_parameters(model)
        slices = GradSlices(model, SliceLayout.of(self.ranks))
        return GradientSink(
            slices,
            replay=slices_drained_into(params, slices),
            sweep=slices_scattered_from_owner(params, slices, group=self.group),
            on_gradient_slices=receive_gradient_slices(params, slices, group=self.group),
        )

    def busiest(self, figures: list[int]) -> list[int]:
        """The largest of each figure over the ranks: what a per-node memory limit must cover."""
        values = torch.tensor(figures, dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values.tolist()

    def summed(self, counts: list[int]) -> list[int]:
        values = torch.tensor(counts, dtype=torch.int64)
        dist.all_reduce(values, group=self.group)
        return values.tolist()

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def placement(self) -> Placement:
        return Placement(self.ranks.sequence_rank, self.ranks.sequence_ranks)

    def owner_kind_kwargs(self, state, shard: int) -> dict:
        return owner_kind_kwargs(state, shard, self.group)

    def hand_over_start_state(self, state, shard: int) -> None:
        """One broadcast per linear array, from the previous owner: its last checkpoint is
        the new owner's first."""
        if state.conv is None:
            return
        previous, owner = state.owner_of(shard - 1), state.owner_of(shard)
        for array in CHECKPOINT_ARRAYS:
            full = getattr(state, array.field)
            if state.rank == previous:
                buffer = full[:, -1].contiguous()
            else:
                buffer = torch.empty_like(full[:, 0])
            dist.broadcast(buffer, group=self.group, group_src=previous)
            if state.rank == owner:
                full[:, 0] = buffer

    def share_final_state(self, state) -> None:
        """The last rank's final linear-attention state, broadcast to every rank."""
        if state.conv is None:
            return
        last = state.world_size - 1
        for array in CHECKPOINT_ARRAYS:
            final = getattr(state, f"final_{array.field}")
            if state.rank == last:
                final.copy_(getattr(state, array.field)[:, -1])
            dist.broadcast(final, group=self.group, group_src=last)

    def recomputed_layers(self, model: PreTrainedModel) -> contextlib.AbstractContextManager:
        # A layer's recomputation in backward would read the prefix across the ranks again, out
        # of step with the servers: the shard keeps its layers' activations instead.
        del model
        return contextlib.nullcontext()

    def shard_name(self, state, shard: int) -> str:
        return f"shard {shard} on rank {state.rank}"

    def finish_owned_shard(self, state) -> None:
        finish_owner(state.rank, self.group)

    def serve_shard(self, model, state, shard: int, cotangent, on_gradient_slices) -> None:
        from longstraw.distributed.sharded_prefill import serve_shard

        serve_shard(
            model, state, shard, group=self.group, cotangent=cotangent,
            on_gradient_slices=on_gradient_slices,
        )  # fmt: skip

    def hand_back_start_cotangent(self, state, cotangent, shard: int) -> None:
        if cotangent.conv is None:
            return
        owner, previous = state.owner_of(shard), state.owner_of(shard - 1)
        for array in CHECKPOINT_ARRAYS:
            buffer = getattr(cotangent, array.field)
            incoming = buffer if state.rank == owner else torch.empty_like(buffer)
            dist.broadcast(incoming, group=self.group, group_src=owner)
            if state.rank == previous:
                buffer.copy_(incoming)

    @property
    def is_leader(self) -> bool:
        return dist.get_rank(self._objects) == 0

    @property
    def _objects(self) -> dist.ProcessGroup | None:
        return self.control if self.control is not None else self.group

    def on_leader(self, call: Callable[[], object]) -> object:
        """`call()` on the group's first rank only; every rank returns its result."""
        message = [call() if self.is_leader else None]
        dist.broadcast_object_list(message, group=self._objects, group_src=0)
        return message[0]
