"""A rank that dies mid-prefill fails the call; the rerun resumes from the recorded shards.

Every rank writes only its own shards (one writer per chunk); rank 0 commits once all are recorded.
P = 200 (T = 199) in 33-token shards: 7 shards, split 3 + 2 + 2 over 3 ranks / 4 + 3 over 2. A
rank exits hard (os._exit) right after one of its shards is recorded; the rerun must compute only
the shards after the last recorded one (counted per rank), and its state, the committed state read
back and the exact-mode gradients must equal an uninterrupted sharded run's, bitwise.
"""

from __future__ import annotations

import pytest
from _workers import budgeted_sharded_sessions, persisted_prefill_dying, resume_persisted_prefill

import longstraw.distributed.exchange
import longstraw.models.checkpoint  # noqa: F401
from longstraw.distributed.launch import RankFailedError, run_on_ranks
from longstraw.distributed.sharded_state import scatter_state
from longstraw.engine.state_layout import state_layout

# Every test here launches ranks (`run_on_ranks`).
pytestmark = pytest.mark.processes

PROMPT_LEN, SHARD_TOKENS, NUM_SHARDS = 200, 33, 7
# (family, ranks, dying rank, the shard after which it dies, expected per rank:
#  (computed, restored, boundary reads) on the rerun).
CASES = [
    # Rank 1 dies after its first shard (3): shards 0-3 recorded; rank 2 has to read shard 4
    # (rank 1's last) back before it may record 5.
    ("qwen3_5", 3, 1, 3, [(0, 3, 0), (1, 1, 0), (2, 0, 1)]),
    # Rank 0 dies after shard 1: rank 0 resumes inside its own range.
    ("llama", 2, 0, 1, [(2, 2, 0), (3, 0, 1)]),
    # GLM-5: MLA latents, rope and indexer keys are token arrays like K/V (sparse DSA at P = 200).
    ("glm_moe_dsa", 3, 1, 3, [(0, 3, 0), (1, 1, 0), (2, 0, 1)]),
]


@pytest.mark.parametrize(
    ("family", "world", "dying_rank", "dying_after", "expected"),
    CASES,
    ids=[f"{c[0]}-{c[1]}ranks" for c in CASES],
)
def test_rerun_resumes_from_recorded_shards_and_matches_uninterrupted_run(
    checkpoint_dir, tmp_path, family, world, dying_rank, dying_after, expected
):
    checkpoint, root = str(checkpoint_dir(family)), str(tmp_path / "states")
    with pytest.raises(RankFailedError) as failure:
        run_on_ranks(
            persisted_prefill_dying,
            world,
            checkpoint,
            root,
            PROMPT_LEN,
            SHARD_TOKENS,
            dying_rank,
            dying_after,
            timeout_s=120,
            start_method="fork",
        )
    assert failure.value.rank == dying_rank, failure.value.detail
    assert "exited with code 17" in failure.value.detail

    results = run_on_ranks(
        resume_persisted_prefill,
        world,
        checkpoint,
        root,
        PROMPT_LEN,
        SHARD_TOKENS,
        timeout_s=240,
        start_method="fork",
    )
    assert all(r["resumed_at"] == dying_after + 1 for r in results)
    counts = [(r["computed"], r["restored"], r["boundary_reads"]) for r in results]
    assert counts == expected
    # Recorded shards were not recomputed: only those after the crash point were.
    assert sum(c for c, _, _ in counts) == NUM_SHARDS - dying_after - 1
    assert len({r["ref"] for r in results}) == 1
    assert all(r["state_bitwise"] for r in results)
    assert all(r["committed_bitwise"] for r in results)
    for rank, r in enumerate(results):
        assert r["grads_bitwise"], f"rank {rank}: {r['grad_errors']}"
        assert r["again_computed"] == 0 and r["again_bitwise"]


@pytest.mark.parametrize("family", ["qwen3_5", "glm_moe_dsa"])
def test_sharded_layout_is_the_single_process_layout(load_tiny, family):
    from longstraw.engine.prefill import prefill

    model = load_tiny(family)
    state = prefill(model, list(range(3, 3 + PROMPT_LEN)), shard_tokens=SHARD_TOKENS)
    for rank in range(3):
        assert state_layout(scatter_state(state, rank, 3)) == state_layout(state)


def test_each_rank_prefills_its_slice_straight_into_its_tier(tmp_path, checkpoint_dir):
    """Under a budget of 0 each rank's slice is tiered from its allocation: the per-shard
    session (one call per shard, as the prefill_shard tasks make it) writes every owned shard's
    K/V to the rank's scratch file, both schedules give the sequential schedule's bits, and a rank
    never holds more than one chunk unit of prompt state."""
    results = run_on_ranks(
        budgeted_sharded_sessions, 2, str(checkpoint_dir("qwen3_5")), str(tmp_path),
        PROMPT_LEN, SHARD_TOKENS, timeout_s=240, start_method="fork",
    )  # fmt: skip
    for rank, result in enumerate(results):
        for schedule, r in result.items():
            assert all(r["equal"].values()), f"rank {rank}, {schedule}: {r['equal']}"
            assert r["tiered"] == ["full_attention/k", "full_attention/v"], r["tiered"]
            assert r["committed"] and r["computed"] == (4, 3)[rank], f"rank {rank}: {r}"
            assert 0 < r["peak"] <= r["chunk_unit"], f"rank {rank}, {schedule}: {r}"
            assert r["scratch_left"] == [], f"rank {rank}, {schedule}"
