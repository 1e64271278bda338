"""The persisted sharded prefill on the wavefront schedule: crash, resume, same bits.

P = 200 in 33-token shards (7 shards; 3 + 2 + 2 over 3 ranks, 4 + 3 over 2), synchronous writers
in the crashed run, background ones in the rerun. The wavefront records a rank's shards once the
whole wavefront is done; a rank exits hard right after one of its shards is recorded (or
mid-wavefront, when nothing is recorded yet). The rerun resumes at the next shard — also across
schedules, since both give the same bits — and its state, the committed state read back and the
exact-mode gradients equal an uninterrupted sequential run's, bitwise.
"""

from __future__ import annotations

import pytest
from _wavefront_workers import persisted_prefill_dying_with, resume_persisted_prefill_with

import longstraw.distributed.exchange
import longstraw.models.checkpoint  # noqa: F401
from longstraw.distributed.launch import RankFailedError, run_on_ranks

# Every test here launches ranks (`run_on_ranks`).
pytestmark = pytest.mark.processes

PROMPT_LEN, SHARD_TOKENS, NUM_SHARDS = 200, 33, 7
# (family, ranks, crashed run's schedule, rerun's schedule, dying rank, the shard after which it
#  dies, expected per rank on the rerun: (computed, restored, boundary reads)).
CASES = [
    # Rank 0 computes nothing on the rerun but still answers queries and hands on its state.
    ("qwen3_5", 3, "wavefront", "wavefront", 1, 3, [(0, 3, 0), (1, 1, 0), (2, 0, 1)]),
    # Rank 0 resumes inside its own range on the wavefront (restored and computed shards mixed).
    ("llama", 2, "sequential", "wavefront", 0, 1, [(2, 2, 0), (3, 0, 1)]),
    ("qwen3_5", 2, "wavefront", "sequential", 0, 2, [(1, 3, 0), (3, 0, 1)]),
    # GLM-5 (MLA + sparse DSA): restored latents and indexer keys answer both exchanges.
    ("glm_moe_dsa", 2, "sequential", "wavefront", 0, 1, [(2, 2, 0), (3, 0, 1)]),
    # Rank 2 dies mid-wavefront (-1: inside a decoder layer): the wavefront records a rank's
    # shards only at its end, so nothing was recorded and the rerun computes all 7.
    ("qwen3_5", 3, "wavefront", "wavefront", 2, -1, [(3, 0, 0), (2, 0, 1), (2, 0, 1)]),
]


@pytest.mark.parametrize(
    ("family", "world", "crashed", "rerun", "dying_rank", "dying_after", "expected"),
    CASES,
    ids=[f"{c[0]}-{c[1]}ranks-{c[2]}-then-{c[3]}" for c in CASES],
)
def test_wavefront_persisted_prefill_resumes_and_matches_uninterrupted_run(
    checkpoint_dir, tmp_path, family, world, crashed, rerun, dying_rank, dying_after, expected
):
    checkpoint, root = str(checkpoint_dir(family)), str(tmp_path / "states")
    with pytest.raises(RankFailedError) as failure:
        run_on_ranks(
            persisted_prefill_dying_with,
            world,
            checkpoint,
            root,
            crashed,
            PROMPT_LEN,
            SHARD_TOKENS,
            dying_rank,
            dying_after,
            timeout_s=120,
            start_method="fork",
        )
    assert failure.value.rank == dying_rank, failure.value.detail
    assert failure.value.exit_code == 17

    results = run_on_ranks(
        resume_persisted_prefill_with,
        world,
        checkpoint,
        root,
        rerun,
        PROMPT_LEN,
        SHARD_TOKENS,
        timeout_s=240,
        start_method="fork",
    )
    assert all(r["resumed_at"] == dying_after + 1 for r in results)
    assert [tuple(r["counts"]) for r in results] == expected
    assert sum(r["counts"][0] for r in results) == NUM_SHARDS - dying_after - 1
    assert len({r["ref"] for r in results}) == 1
    for rank, r in enumerate(results):
        assert r["state_bitwise"] and r["committed_bitwise"], f"rank {rank}"
        assert r["grads_bitwise"], f"rank {rank}"


def test_unknown_schedule_is_refused(load_tiny, tmp_path):
    from longstraw.schemas.storage import StateKey, StorageConfig
    from longstraw.training.persisted_prefill import persisted_prefill

    with pytest.raises(ValueError, match="schedule must be one of"):
        persisted_prefill(
            load_tiny("llama"), list(range(20)), shard_tokens=5,
            storage=StorageConfig(root_uri=str(tmp_path)), key=StateKey.policy("s", 0, "w", "p"),
            schedule="diagonal",
        )  # fmt: skip
