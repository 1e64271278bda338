"""GLM-5 (glm_moe_dsa) on the sequence-sharded engine matches the single-process engine (gloo, CPU).

P = 100 (T = 99 state tokens) in 13-token shards: 8 shards, the last one 8 tokens, split 4 + 4
(52 + 47 positions) over 2 ranks and 3 + 3 + 2 (39 + 39 + 21) over 3 ranks. The tiny checkpoint
keeps `index_topk` = 32: the sparse regime, where a rank holding 39 or 52 positions really cuts
its local top-k and later prefill shards and every branch select 32 of up to 110 positions
(layers 0 and 2 select, layer 1 is `shared`); `index_topk` = 2^20 is the dense regime. Each case
is one launch of its ranks (fork; ~3 s).
"""

from __future__ import annotations

import functools

import pytest
import torch
from _workers import (
    compare_with_single_process,
    glm_branch_traffic_and_saved_tensors,
    glm_sweep_with_corrupted_latent,
)

import longstraw.distributed.exchange
import longstraw.engine.group
import longstraw.models.checkpoint  # noqa: F401
from longstraw.distributed.launch import RankFailedError, run_on_ranks
from longstraw.models.glm import local_topk_candidates
from longstraw.ops.dsa_topk import global_topk, naive_stable_topk_mask

# Every test here launches ranks (`run_on_ranks`).
pytestmark = pytest.mark.processes

PROMPT_LEN, SHARD_TOKENS = 100, 13
START_METHOD = "fork"
SPARSE, DENSE = 32, 1 << 20
CASES = [(2, SPARSE), (3, SPARSE), (2, DENSE), (3, DENSE)]
# STYLE.md: fp32 reorderings rtol 1e-5 / atol 1e-6 (the cross-rank merge reorders sums).
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
# Gradients: worst per-tensor max_diff / max|ref| measured 1.1e-6 (dense, 3 ranks, detached),
# RMS-relative 1.9-2.4e-7; the same bound as the K/V families' test.
GRAD_MAX_REL = 1e-5


@functools.cache
def _results(checkpoint: str, world: int, index_topk: int) -> tuple[dict, ...]:
    return tuple(
        run_on_ranks(
            compare_with_single_process,
            world,
            checkpoint,
            PROMPT_LEN,
            SHARD_TOKENS,
            index_topk,
            timeout_s=240,
            start_method=START_METHOD,
        )
    )


@pytest.fixture(
    params=CASES,
    ids=[f"{w}ranks-{'sparse' if k == SPARSE else 'dense'}" for w, k in CASES],
)
def results(request, checkpoint_dir):
    world, index_topk = request.param
    return _results(str(checkpoint_dir("glm_moe_dsa")), world, index_topk)


def test_sharded_latents_are_bitwise_the_single_process_state_sliced(results):
    assert all(r["placement_bitwise"] for r in results)
    # Each rank holds only its positions' latents, rope and indexer keys: they add up to the whole.
    assert sum(r["local_state_bytes"] for r in results) == results[0]["total_state_bytes"]


def test_sharded_glm_prefill_state_matches_single_process_prefill(results):
    worst = max(r["state_max_rel"] for r in results)
    assert worst <= FP32_RTOL, f"max_diff / max|ref| {worst:.3e}"


def test_global_dsa_topk_selects_the_single_process_positions(results):
    """Every DSA call of the sharded prefill (owner's shards) and replay selects exactly the
    positions the single-process engine selects (None == None in the dense regime)."""
    for rank, r in enumerate(results):
        for stage in ("prefill", "replay"):
            differ, total = r[f"{stage}_selection"]
            assert total > 0 and differ == 0, f"rank {rank} {stage}: {differ} of {total} differ"
    sparse = sum(r["prefill_sparse_calls"] + r["replay_sparse_calls"] for r in results)
    dense = results[0]["replay_sparse_calls"] == 0
    assert (sparse == 0) == dense


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_sharded_glm_logprobs_match_single_process(results, mode):
    worst = max(r[f"{mode}_logp_max_diff"] for r in results)
    assert worst <= FP32_RTOL * 7 + FP32_ATOL, f"max_diff {worst:.3e}"
    assert all(r[f"{mode}_logps"] == results[0][f"{mode}_logps"] for r in results)
    placed = max(r["placed_replay_logp_max_diff"] for r in results)
    assert placed <= FP32_RTOL * 7 + FP32_ATOL, f"replay on the placed state: max_diff {placed:.3e}"


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_sharded_glm_gradients_match_single_process_gradients(results, mode):
    for rank, r in enumerate(results):
        errors = r[f"{mode}_grad"]
        assert errors["max_rel"] <= GRAD_MAX_REL, f"rank {rank}: {errors}"


class _Indexer:
    """The two attributes `index_scores` reads."""

    softmax_scale = 0.25
    index_topk = 5


def test_global_topk_of_local_topks_is_the_stable_topk_of_all_positions():
    """Rank-local top-k's merged: the first k of a stable descending sort over every position,
    on scores with many exact ties (relu zeros and repeated values), split unevenly in 3."""
    gen = torch.Generator().manual_seed(42)
    batch, queries, heads, dim, num, topk = 2, 7, 2, 4, 41, _Indexer.index_topk
    # Integer-valued queries/keys: many scores repeat exactly, most relu to exactly zero.
    q = torch.randint(-2, 3, (batch, queries, heads, dim), generator=gen).float()
    weights = torch.ones(batch, queries, heads)
    keys = torch.randint(-1, 2, (num, dim), generator=gen).float()
    from longstraw.models.glm import index_scores

    scores = index_scores(_Indexer, q, weights, keys)
    want = naive_stable_topk_mask(scores, topk).nonzero()[:, 2].view(batch, queries, topk)
    bounds = [(0, 17), (17, 30), (30, 41)]
    parts = [local_topk_candidates(_Indexer, q, weights, keys[a:b], a, topk) for a, b in bounds]
    got = global_topk(torch.cat(parts, dim=2), topk)
    assert torch.equal(got, want), f"{(got != want).sum().item()} positions differ"
    # Ties really decide: more than k positions share the k-th score in some row.
    kth = scores.sort(dim=-1, descending=True).values[..., topk - 1 : topk]
    assert ((scores == kth).sum(-1) > 1).any()


def test_sharded_glm_branch_traffic_is_query_sized_and_nothing_prompt_sized_is_saved(
    checkpoint_dir,
):
    results = run_on_ranks(
        glm_branch_traffic_and_saved_tensors,
        2,
        str(checkpoint_dir("glm_moe_dsa")),
        SHARD_TOKENS,
        timeout_s=240,
        start_method=START_METHOD,
    )
    # Tiny GLM: 3 MLA layers, H 4, R 32, E 8; 2 of them select (K 32) in the sparse regime.
    # Per layer: all_gather (out, lse) H·S·(R+1)·4 B, backward all_reduce of dq H·S·(R+E)·4 B;
    # per selecting layer: all_gather of K (score, position) pairs per query, S·K·2·8 B.
    length = results[0]["response_len"]
    expected = 3 * (4 * length * 33 * 4 + 4 * length * 40 * 4) + 2 * (length * 32 * 2 * 8)
    for r in results:
        assert r["branch_bytes_100"] == r["branch_bytes_300"] == expected
        assert r["saved"][100] == r["saved"][300], f"saved tensors grow with P: {r['saved']}"


def test_sharded_glm_sweep_refuses_a_latent_that_does_not_reproduce(checkpoint_dir):
    with pytest.raises(RankFailedError) as failure:
        run_on_ranks(
            glm_sweep_with_corrupted_latent,
            2,
            str(checkpoint_dir("glm_moe_dsa")),
            SHARD_TOKENS,
            timeout_s=240,
            start_method=START_METHOD,
        )
    assert failure.value.rank == 1
    assert (
        "RecomputedStateMismatchError" in failure.value.detail and "latent" in failure.value.detail
    )


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_streams_its_latents_under_a_budget_bitwise(checkpoint_dir, world):
    """`engine.state_budget_bytes` = 0 on the ranks (sparse DSA): each rank's latents, rope and
    indexer keys (and, exact, their cotangents) stream in 16-position chunks; replay, the exact
    sweep and sampling give the resident slice's bits, within two chunk units."""
    results = _results(str(checkpoint_dir("glm_moe_dsa")), world, SPARSE)
    for rank, r in enumerate(results):
        for case, got in r["budget"].items():
            assert got["grads_equal"] and got["logps_equal"], f"rank {rank}, {case}: {got}"
            assert got["samples_equal"], f"rank {rank}, {case}: sampled tokens differ"
            assert got["bytes_read"] >= got["state_bytes"], f"rank {rank}, {case}: {got}"
            assert 0 < got["peak"] <= 2 * got["chunk_unit"], f"rank {rank}, {case}: {got}"
            assert got["scratch_left"] == [], f"rank {rank}, {case}: scratch files left"
        assert sorted(r["budget"]) == [
            "detached-disk", "detached-host", "whole-disk", "whole-host"
        ]  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
def test_segments_and_prefix_trees_on_the_ranks_match_one_process(checkpoint_dir, world):
    """A long branch's segments (3-4 tokens) and a prefix tree of three responses over the
    sharded latents (sparse DSA): every rank reads the earlier segments as causal branch keys,
    as one process does; gradients and log-probs as one process with the same options."""
    from _workers import BRANCH_CASES

    results = _results(str(checkpoint_dir("glm_moe_dsa")), world, SPARSE)
    for rank, r in enumerate(results):
        assert sorted(r["branches"]) == sorted(c[0] for c in BRANCH_CASES)
        for case, got in r["branches"].items():
            assert got["grad"]["max_rel"] <= GRAD_MAX_REL, f"rank {rank}, {case}: {got['grad']}"
            assert got["logp_max_diff"] <= 1e-5 * 7 + 1e-6, f"rank {rank}, {case}"
            assert got["logps"] == results[0]["branches"][case]["logps"], f"rank {rank}, {case}"
