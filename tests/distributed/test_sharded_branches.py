"""Segmented replay and shared response prefixes over a sequence-sharded prompt state (gloo, CPU)
match the single-process engine with the same options.

The replay code is one (`engine.group.replay_group_branches`, `engine.segmented_replay`,
`engine.branch_tree`); on the ranks it reads the prompt through the cross-rank exchange, and a
long branch's earlier segments — the same on every rank — are merged after the gathered prompt
partials. The tiny qwen3_5 hybrid (full attention and Gated DeltaNet), P = 120 in 33-token
shards (4 shards, 2 + 2 over 2 ranks), three responses sharing turns (`_shared_prefix_group`).
One launch of the ranks; the tests below read its results.
"""

from __future__ import annotations

import functools

import pytest
from _workers import BRANCH_CASES, BUDGET_CASES, branches_against_single_process

from longstraw.distributed.launch import run_on_ranks

# Every test here launches ranks (`run_on_ranks`).
pytestmark = pytest.mark.processes

PROMPT_LEN, SHARD_TOKENS, WORLD = 120, 33, 2
# As tests/distributed/test_sharded_engine.py: the cross-rank merge reorders fp32 sums.
GRAD_MAX_REL = 1e-5
LOGP_MAX_DIFF = 1e-5 * 7 + 1e-6


@functools.cache
def _results(checkpoint: str) -> tuple[dict, ...]:
    return tuple(
        run_on_ranks(
            branches_against_single_process,
            WORLD,
            checkpoint,
            PROMPT_LEN,
            SHARD_TOKENS,
            timeout_s=300,
            start_method="fork",
        )
    )


@pytest.fixture
def results(checkpoint_dir):
    return _results(str(checkpoint_dir("qwen3_5")))


@pytest.mark.parametrize("case", [c[0] for c in BRANCH_CASES])
def test_sharded_branches_match_single_process(results, case):
    for rank, r in enumerate(results):
        got = r[case]
        assert got["grad"]["max_rel"] <= GRAD_MAX_REL, f"rank {rank}: {got['grad']}"
        assert got["logp_max_diff"] <= LOGP_MAX_DIFF, f"rank {rank}: {got['logp_max_diff']:.3e}"
    # Replicated replay: every rank computed the same log-probs, bit for bit.
    assert all(r[case]["logps"] == results[0][case]["logps"] for r in results)


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("case", [c[0] for c in BUDGET_CASES])
def test_each_rank_streams_its_slice_under_a_budget_bitwise(results, case, tier):
    """`engine.state_budget_bytes` = 0 on the ranks: each rank's slice (and, exact, its slice of
    dS) lives in the lower tier and streams in 16-position chunks; replay, segments, the prefix
    tree, the exact sweep and sampling give the resident slice's bits, within one chunk unit of
    resident state beyond the budget plus one prefetched unit."""
    for rank, r in enumerate(results):
        got = r["budget"][f"{case}-{tier}"]
        assert got["grads_equal"] and got["logps_equal"], f"rank {rank}: {got}"
        assert got["samples_equal"], f"rank {rank}: sampled tokens differ"
        # Everything was streamed: at least the slice read once; nothing resident for good.
        assert got["bytes_read"] >= got["state_bytes"], f"rank {rank}: {got}"
        assert 0 < got["peak"] <= 2 * got["chunk_unit"], f"rank {rank}: {got}"
        if case != "detached":
            assert got["bytes_written"] > 0, f"rank {rank}: no cotangent written back"
        assert got["scratch_left"] == [], f"rank {rank}: scratch files left behind"
