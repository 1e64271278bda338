"""What the processes that hold one prompt state agree on, and how: one process agrees with
itself.

On a sequence group of ranks every rank runs the same stage on its part of the state
(`longstraw.distributed.collectives.CrossRankCollectives`): the figures a memory limit must
cover are the busiest rank's, counts are summed, a call with side effects (a user's environment)
is made once, on the first rank, and every rank checks that all drew the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Collectives:
    """The one process that holds the whole state."""

    @property
    def is_leader(self) -> bool:
        """Whether this process makes the calls `on_leader` runs."""
        return True

    def on_leader(self, call: Callable[[], object]) -> object:
        """`call()` made once (here), its result returned; `call` must not raise (return the
        error instead) so that every rank goes on the same way."""
        return call()

    def check_draws(self, choice_G1: torch.Tensor, step: int) -> None:
        """Called with every decode step's draws [G, 1] before they are used."""
        del choice_G1, step

    def busiest(self, figures: list[int]) -> list[int]:
        """Per figure (peak bytes, bytes moved), its largest value over the processes that hold
        the state: here, this one's."""
        return list(figures)

    def summed(self, counts: list[int]) -> list[int]:
        """Per count (shards computed, shards read back), its sum over the processes that hold
        the state: here, this one's."""
        return list(counts)

    def barrier(self) -> None:
        """Wait until every process that holds the state is here (one process: it is)."""


ONE_PROCESS = Collectives()
