"""What the ranks of a sequence group agree on while they run one stage on their parts of a
prompt state (`engine.collectives` is one process's).

Every rank runs the same branch, the same decode step, the same prefill loop: the figures a
memory limit must cover are the busiest rank's, counts are summed over the ranks, a call with
side effects (a user's environment) is made on the group's first rank and its result broadcast,
and after every decode step the ranks check that they drew the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from longstraw.distributed.cross_rank_attention import COMM
from longstraw.engine.collectives import Collectives


class ReplicaDivergenceError(RuntimeError):
    """Ranks of the sequence group drew different tokens in a replicated decode step."""


@dataclass(frozen=True)
class CrossRankCollectives(Collectives):
    """The ranks of `group` (None: the default group); `control` carries the Python objects
    `on_leader` hands out (a gloo group where `group` is NCCL; None: `group` itself)."""

    group: dist.ProcessGroup | None = None
    control: dist.ProcessGroup | None = None

    @property
    def _objects(self) -> dist.ProcessGroup | None:
        return self.control if self.control is not None else self.group

    @property
    def is_leader(self) -> bool:
        return dist.get_rank(self._objects) == 0

    def on_leader(self, call: Callable[[], object]) -> object:
        """`call()` on the group's first rank only; every rank returns its result."""
        message = [call() if self.is_leader else None]
        dist.broadcast_object_list(message, group=self._objects, group_src=0)
        return message[0]

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
