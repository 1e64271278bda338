"""The run's ranks as R replicas × S sequence ranks (`distributed.topology.Topology`): every
global rank has one (replica, sequence rank) and back, replicas and data groups partition the
world, and the gradient rows a rank accumulates follow from it."""

from __future__ import annotations

import pytest
import torch

from longstraw.distributed.gradient_slices import SliceLayout
from longstraw.distributed.topology import Topology
from longstraw.schemas.run import ParallelConfig

SHAPES = [(1, 1), (2, 1), (2, 2), (4, 2), (6, 3), (6, 2), (8, 1), (8, 8)]


@pytest.mark.parametrize(("world", "replicas"), SHAPES)
def test_every_rank_has_one_place_and_the_places_give_the_rank_back(world, replicas):
    places = set()
    for rank in range(world):
        t = Topology(world, replicas, rank)
        assert t.sequence_ranks * t.replicas == world
        assert 0 <= t.replica < replicas and 0 <= t.sequence_rank < t.sequence_ranks
        assert t.global_rank(t.replica, t.sequence_rank) == rank
        # Consecutive ranks share a replica (d · S + s): a replica's ranks are one node's.
        assert rank in t.replica_ranks(t.replica) and rank in t.data_ranks(t.sequence_rank)
        places.add((t.replica, t.sequence_rank))
    assert len(places) == world


@pytest.mark.parametrize(("world", "replicas"), SHAPES)
def test_replicas_and_data_groups_each_partition_the_world(world, replicas):
    t = Topology(world, replicas)
    by_replica = [t.replica_ranks(d) for d in range(replicas)]
    by_sequence = [t.data_ranks(s) for s in range(t.sequence_ranks)]
    assert sorted(r for ranks in by_replica for r in ranks) == list(range(world))
    assert sorted(r for ranks in by_sequence for r in ranks) == list(range(world))
    assert by_replica[-1] == tuple(range(world - t.sequence_ranks, world))
    assert by_sequence[0] == tuple(range(0, world, t.sequence_ranks))


def test_one_process_is_every_degree_at_one():
    t = Topology()
    assert t.world_size == t.replicas == t.sequence_ranks == 1
    assert t.replica == t.sequence_rank == 0
    assert Topology.of(ParallelConfig()) == t


def test_the_run_config_gives_the_topology():
    t = Topology.of(ParallelConfig(world_size=6, data_parallel=2), rank=4)
    assert (t.sequence_ranks, t.replica, t.sequence_rank) == (3, 1, 1)


@pytest.mark.parametrize(
    ("world", "replicas", "rank", "said"),
    [
        (4, 3, 0, "world_size 4 is not a multiple of data_parallel 3"),
        (4, 0, 0, "world_size 4 is not a multiple of data_parallel 0"),
        (4, 2, 4, "rank 4 is not in a world of 4 ranks"),
        (4, 2, -1, "rank -1 is not in a world of 4 ranks"),
    ],
)
def test_an_impossible_topology_is_refused(world, replicas, rank, said):
    with pytest.raises(ValueError, match=said):
        Topology(world, replicas, rank)


@pytest.mark.parametrize("dim0", [1, 5, 12, 63])
@pytest.mark.parametrize(("world", "replicas"), SHAPES)
def test_a_ranks_gradient_rows_are_its_sequence_index_in_every_replica(dim0, world, replicas):
    # FSDP over the flattened (data, seq) mesh: global rank g holds chunk g of dim 0.
    chunks = torch.chunk(torch.arange(dim0), world)
    for rank in range(world):
        t = Topology(world, replicas, rank)
        layout = SliceLayout.of(t)
        pieces = layout.pieces(dim0)
        assert len(pieces) == replicas
        for g, (start, end) in zip(t.data_ranks(t.sequence_rank), pieces, strict=True):
            want = chunks[g] if g < len(chunks) else torch.arange(dim0)[:0]
            assert torch.equal(torch.arange(dim0)[start:end], want), (rank, g)
        assert layout.topology.data_ranks(t.sequence_rank) == t.data_ranks(t.sequence_rank)
