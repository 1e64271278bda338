"""The run's ranks as one object: R data replicas of S sequence ranks, and this rank's place.

Legend: W ranks in the run, R data replicas (`parallel.data_parallel`), S = W / R sequence ranks
per replica (they share each prompt's state); global rank g = d · S + s for replica d and
sequence rank s. One process is W = R = S = 1.

Built once, where the rank group starts (`stage_group`), and handed down: the groups each replica
and each sequence index get, the replica a rank's gradients belong to, the rows of the gradient a
rank accumulates (`gradient_slices.SliceLayout`) all read it. torchtitan's `ParallelDims` is the
model: every degree in one place, one process being every degree at 1.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """W ranks as R replicas × S sequence ranks, seen from global rank `rank`."""

    world_size: int = 1
    """W: every rank of the run."""
    replicas: int = 1
    """R: data replicas, each running its own groups."""
    rank: int = 0
    """g: this process's global rank."""

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.world_size % self.replicas:
            raise ValueError(
                f"world_size {self.world_size} is not a multiple of data_parallel {self.replicas}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size} ranks")

    @classmethod
    def of(cls, parallel, rank: int = 0) -> Topology:
        """Rank `rank` of a run's `ParallelConfig`."""
        return cls(world_size=parallel.world_size, replicas=parallel.data_parallel, rank=rank)

    @property
    def sequence_ranks(self) -> int:
        """S: the ranks that share one prompt's state."""
        return self.world_size // self.replicas

    @property
    def replica(self) -> int:
        """d: this rank's replica."""
        return self.rank // self.sequence_ranks

    @property
    def sequence_rank(self) -> int:
        """s: this rank's index in its replica's sequence group."""
        return self.rank % self.sequence_ranks

    def global_rank(self, replica: int, sequence_rank: int) -> int:
        """g of sequence rank `sequence_rank` of replica `replica`."""
        return replica * self.sequence_ranks + sequence_rank

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        """[S] global ranks of replica `replica`, in sequence order."""
        return tuple(self.global_rank(replica, s) for s in range(self.sequence_ranks))

    def data_ranks(self, sequence_rank: int) -> tuple[int, ...]:
        """[R] global ranks at `sequence_rank` of every replica, in replica order: where the
        replicas' gradients are summed."""
        return tuple(self.global_rank(d, sequence_rank) for d in range(self.replicas))
