"""Rollout over a sequence-sharded prompt state matches the single-process rollout (gloo, CPU).

K/V families: P = 200 (T = 199 state tokens) in 33-token shards = 7 shards, split 4 + 3 (llama,
2 ranks) and 3 + 2 + 2 (qwen3_5, 3 ranks). GLM-5: P = 100 in 13-token shards = 8 shards, split
4 + 4 and 3 + 3 + 2, sparse DSA (`index_topk` 32 of 99 + branch positions). Neither tokens nor
shards divide evenly. Each case is one fork launch of its ranks (launches are slow); the tests read
its results.
"""

from __future__ import annotations

import functools

import pytest
from _workers import rollout_against_single_process, rollout_with_divergent_seed

import longstraw.distributed.exchange
import longstraw.engine.prefill
import longstraw.engine.rollout
import longstraw.models.checkpoint  # noqa: F401
from longstraw.distributed.launch import RankFailedError, run_on_ranks

# Every test here launches ranks (`run_on_ranks`).
pytestmark = pytest.mark.processes

START_METHOD = "fork"
CASES = [("llama", 2, 200, 33), ("qwen3_5", 3, 200, 33), ("glm_moe_dsa", 2, 100, 13),
         ("glm_moe_dsa", 3, 100, 13)]  # fmt: skip
# The sampler's log-probs (a batched decode step over the sharded prefix) against the
# single-process sampler / a single-process replay: fp32 reorderings, |logp| ~ 6, so STYLE.md's
# rtol 1e-5 of that plus atol 1e-6. Measured max_diff 4.8e-7 (0 for llama/qwen3_5 greedy).
LOGP_ATOL = 1e-5 * 7 + 1e-6


@functools.cache
def _results(checkpoint: str, world: int, prompt_len: int, shard_tokens: int) -> tuple[dict, ...]:
    return tuple(
        run_on_ranks(
            rollout_against_single_process,
            world,
            checkpoint,
            prompt_len,
            shard_tokens,
            2 * prompt_len + 1,
            timeout_s=240,
            start_method=START_METHOD,
        )
    )


@pytest.fixture(params=CASES, ids=[f"{f}-{w}ranks" for f, w, _, _ in CASES])
def results(request, checkpoint_dir):
    family, world, prompt_len, shard_tokens = request.param
    return _results(str(checkpoint_dir(family)), world, prompt_len, shard_tokens)


def test_greedy_sharded_rollout_draws_the_single_process_tokens(results):
    for rank, r in enumerate(results):
        assert r["greedy_tokens_equal"], f"rank {rank}: {r['greedy']}"
        assert r["greedy_logp_max_diff"] <= LOGP_ATOL, f"rank {rank}: {r['greedy_logp_max_diff']}"
        assert all(len(t) == 9 and f == "length" for t, _, f in r["greedy"])


def test_sharded_decode_selects_the_single_process_dsa_positions(results):
    """GLM-5: every decode step's global top-k equals the single-process selection (K/V
    families: nothing to compare)."""
    for rank, r in enumerate(results):
        differ, compared = r["decode_selection"]
        assert differ == 0, f"rank {rank}: {differ} of {compared} decode DSA calls differ"
    if results[0]["decode_sparse_calls"]:
        # 9 steps x 2 selecting layers + the shared one.
        assert results[0]["decode_sparse_calls"] == 27


def test_seeded_sampling_is_identical_on_every_rank_and_matches_a_single_process_replay(results):
    for rank, r in enumerate(results):
        assert r["sampled"] == results[0]["sampled"], f"rank {rank} drew otherwise"
        assert r["greedy"] == results[0]["greedy"]
        assert r["sampled_vs_replay_max_diff"] <= LOGP_ATOL, (
            f"rank {rank}: max_diff {r['sampled_vs_replay_max_diff']:.3e}"
        )
    # Four rows really were sampled (not all the same).
    assert len({tuple(t) for t, _, _ in results[0]["sampled"]}) == 4


def test_stop_ids_and_max_new_tokens_end_rows_as_single_process(results):
    for rank, r in enumerate(results):
        assert r["greedy_stop_equal"], f"rank {rank}: {r['greedy_stop']}"
        assert all(len(t) == r["greedy_stop_len"] and f == "stop" for t, _, f in r["greedy_stop"])
        # Same seed, stop ids drawn at step 3 of rows 0 and 1: each row is the unstopped draw
        # cut at its first stop id (kept), else the whole max_new_tokens with "length".
        stops = set(r["sampled_stop_ids"])
        for (full, full_logp, _), (tokens, logp, finish) in zip(
            r["sampled"], r["sampled_stop"], strict=True
        ):
            first = next((i for i, t in enumerate(full) if t in stops), None)
            if first is None:
                assert (tokens, logp, finish) == (full, full_logp, "length")
            else:
                cut = first + 1
                assert (tokens, logp, finish) == (full[:cut], full_logp[:cut], "stop")
        assert r["sampled_stop"] == results[0]["sampled_stop"]


def test_sharded_decode_hands_collectives_query_sized_bytes_independent_of_the_prompt(results):
    """Bytes per rank = steps x the per-step formula (docs/scaling.md), the same on a prompt
    twice as long: no prefix state moves."""
    for rank, r in enumerate(results):
        assert r["greedy_bytes"] == r["greedy_bytes_formula"], f"rank {rank}"
        assert r["greedy_bytes_second_prompt"] == r["greedy_bytes"], f"rank {rank}"
        steps = max(len(t) for t, _, _ in r["sampled_stop"])
        assert r["sampled_stop_bytes"] == steps * r["bytes_per_step"], f"rank {rank}"


def test_agent_trajectories_on_the_ranks_are_the_single_process_ones(results):
    """Multi-turn rollout over the sharded prefix: the same turns, observations and log-probs
    as one process over the whole state, on every rank; the environment runs on the first rank
    only (reset + 3 steps per trajectory; reset + 2 for the failing one), and a tool failure ends the branch on
    every rank with the first rank's error."""
    for rank, r in enumerate(results):
        for name, case in r["agent"].items():
            assert case["tokens_equal"], f"rank {rank}, {name}: {case['got']}"
            assert case["logp_max_diff"] <= LOGP_ATOL, f"rank {rank}, {name}"
            assert case["got"] == results[0]["agent"][name]["got"], f"rank {rank}, {name}"
        calls = {name: case["environment_calls"] for name, case in r["agent"].items()}
        assert calls == ({"greedy": 8, "sampled": 8, "failing": 3} if rank == 0 else
                         dict.fromkeys(calls, 0)), f"rank {rank}: {calls}"  # fmt: skip
    greedy, failing = results[0]["agent"]["greedy"]["got"], results[0]["agent"]["failing"]["got"]
    assert all(t[3] == "done" and t[4] == 3.0 and t[1].count(0) == 2 * 4 for t in greedy), greedy
    assert failing[0][3] == "error" and "tool failed at turn 2" in failing[0][5], failing


def test_a_rank_drawing_differently_fails_every_rank_instead_of_hanging(checkpoint_dir):
    with pytest.raises(RankFailedError, match="ReplicaDivergenceError"):
        run_on_ranks(
            rollout_with_divergent_seed,
            2,
            str(checkpoint_dir("llama")),
            1,
            timeout_s=120,
            start_method=START_METHOD,
        )
