"""Sequence-sharded prefill, replay and gradients match the single-process engine (gloo, CPU).

P = 200 (T = 199 state tokens) in 33-token shards: 7 shards, the last one 1 token, split 4 + 3 over
2 ranks and 3 + 2 + 2 over 3 ranks, so neither tokens nor shards divide evenly. Each case is one
launch of its ranks (spawn + imports dominate: ~10-15 s); the tests below read its results.
"""

from __future__ import annotations

import functools

import pytest
from _workers import compare_with_single_process

import longstraw.distributed.exchange
import longstraw.engine.group
import longstraw.models.checkpoint  # noqa: F401
from longstraw.distributed.launch import run_on_ranks

# Every test here launches ranks (`run_on_ranks`).
pytestmark = pytest.mark.processes

PROMPT_LEN, SHARD_TOKENS = 200, 33
# fork: ranks inherit the imported torch/transformers/longstraw (spawn re-imports: ~10 s a rank).
START_METHOD = "fork"
CASES = [("llama", 2), ("qwen3_5", 3)]
# STYLE.md: fp32 reorderings rtol 1e-5 / atol 1e-6 (the cross-rank merge reorders sums).
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
# Gradients: worst per-tensor max_diff / max|ref| measured 9.4e-7 (qwen3_5, detached),
# RMS-relative 1.9-3.8e-7; the bound leaves 10x margin.
GRAD_MAX_REL = 1e-5


@functools.cache
def _results(checkpoint: str, world: int) -> tuple[dict, ...]:
    return tuple(
        run_on_ranks(
            compare_with_single_process,
            world,
            checkpoint,
            PROMPT_LEN,
            SHARD_TOKENS,
            timeout_s=240,
            start_method=START_METHOD,
        )
    )


@pytest.fixture(params=CASES, ids=[f"{f}-{w}ranks" for f, w in CASES])
def results(request, checkpoint_dir):
    family, world = request.param
    return _results(str(checkpoint_dir(family)), world)


def test_sharded_state_placement_is_bitwise_the_single_process_state(results):
    assert all(r["placement_bitwise"] for r in results)
    # Each rank holds only its positions: the per-rank K/V add up to the whole.
    assert sum(r["local_state_bytes"] for r in results) == results[0]["total_state_bytes"]


def test_sharded_prefill_state_matches_single_process_prefill(results):
    worst = max(r["state_max_rel"] for r in results)
    assert worst <= FP32_RTOL, f"max_diff / max|ref| {worst:.3e}"


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_sharded_logprobs_match_single_process_and_agree_bitwise_across_ranks(results, mode):
    worst = max(r[f"{mode}_logp_max_diff"] for r in results)
    # |logp| ~ 6: rtol 1e-5 of that plus atol.
    assert worst <= FP32_RTOL * 7 + FP32_ATOL, f"max_diff {worst:.3e}"
    assert all(r[f"{mode}_logps"] == results[0][f"{mode}_logps"] for r in results)


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_sharded_gradients_match_single_process_gradients(results, mode):
    for rank, r in enumerate(results):
        errors = r[f"{mode}_grad"]
        assert errors["max_rel"] <= GRAD_MAX_REL, f"rank {rank}: {errors}"
