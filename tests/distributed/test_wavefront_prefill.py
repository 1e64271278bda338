"""The layer-wavefront prefill gives the sequential schedule's state bit for bit (gloo, CPU).

Cases: P = 22 (21 state tokens) in 2-token shards = 11 shards, split 6 + 5 over 2 ranks and
4 + 4 + 3 over 3 ranks — the tiny Qwen3.5's conv tail is 3 inputs wide, so every tail spans
2 shards and the handoff at each rank boundary carries inputs of two shards; and the engine
tests' P = 200 in 33-token shards (7 shards, the last 1 token, 3 + 2 + 2). GLM-5 (MLA + DSA) as in
test_sharded_glm.py: P = 100 in 13-token shards (8 shards, 4 + 4 / 3 + 3 + 2), the checkpoint's
`index_topk` 32 (sparse: shards ending past position 32 select — both exchanges per selecting
layer, the `shared` layer 1 reusing layer 0's selection) and 2^20 (dense: no selection, one
exchange per layer). Each case is one fork launch; the tests read its results.
"""

from __future__ import annotations

import functools

import pytest
from _wavefront_workers import (
    die_during_wavefront,
    wavefront_against_sequential,
    wavefront_on_subgroups,
)

import longstraw.distributed.exchange
import longstraw.distributed.wavefront_prefill
import longstraw.models.checkpoint  # noqa: F401
from longstraw.distributed.launch import RankFailedError, run_on_ranks

# Every test here launches ranks (`run_on_ranks`).
pytestmark = pytest.mark.processes

START_METHOD = "fork"
SPARSE, DENSE = 32, 1 << 20  # GLM-5 `index_topk`: the tiny checkpoint's, and everything
# (family, ranks, prompt length, shard tokens, attention window: None = all owned shards,
# GLM-5 index_topk: None = the checkpoint's)
CASES = [
    ("llama", 2, 22, 2, None, None),
    ("llama", 3, 200, 33, None, None),
    ("qwen3_5", 2, 22, 2, None, None),
    ("qwen3_5", 3, 22, 2, None, None),
    ("qwen3_5", 3, 200, 33, None, None),
    ("qwen3", 3, 22, 2, None, None),
    ("qwen3_next", 2, 22, 2, None, None),
    # At most 1 / 2 shards inside attention at once: the same bits, other interleavings.
    ("qwen3_5", 3, 22, 2, 1, None),
    ("llama", 3, 22, 2, 2, None),
    ("glm_moe_dsa", 2, 100, 13, None, SPARSE),
    ("glm_moe_dsa", 3, 100, 13, None, SPARSE),
    ("glm_moe_dsa", 2, 100, 13, None, DENSE),
    ("glm_moe_dsa", 3, 100, 13, None, DENSE),
    # GLM-5 with one shard paused at a time: select, attend, finish, then the next shard.
    ("glm_moe_dsa", 3, 100, 13, 1, SPARSE),
]


def _case_id(family, world, prompt_len, shard_tokens, window, index_topk) -> str:
    regime = "" if index_topk is None else "-sparse" if index_topk == SPARSE else "-dense"
    return f"{family}-{world}ranks-P{prompt_len}-S{shard_tokens}-window{window}{regime}"


@functools.cache
def _results(
    checkpoint: str,
    world: int,
    prompt_len: int,
    shard_tokens: int,
    window: int | None,
    index_topk: int | None,
) -> tuple[dict, ...]:
    return tuple(
        run_on_ranks(
            wavefront_against_sequential,
            world,
            checkpoint,
            prompt_len,
            shard_tokens,
            True,
            window,
            index_topk,
            timeout_s=240,
            start_method=START_METHOD,
        )
    )


@pytest.fixture(params=CASES, ids=[_case_id(*case) for case in CASES])
def results(request, checkpoint_dir):
    family, world, prompt_len, shard_tokens, window, index_topk = request.param
    return _results(
        str(checkpoint_dir(family)), world, prompt_len, shard_tokens, window, index_topk
    )


def test_wavefront_prefill_state_is_bitwise_the_sequential_state(results):
    for rank, r in enumerate(results):
        for name, field in r["fields"].items():
            assert field["bitwise"], f"rank {rank} {name}: max_diff {field['max_diff']:.3e}"
    # Placement: contiguous shard ranges in rank order, every rank owning some (the shapes are
    # the sequential state's: torch.equal above needs them equal).
    owned = [s for r in results for s in r["shards"]]
    assert owned == list(range(len(owned))) and all(r["shards"] for r in results)


def test_exact_sweep_on_the_wavefront_state_gives_the_sequential_gradients(results):
    # The reverse sweep recomputes every shard and refuses (RecomputedStateMismatchError) one that is not
    # bitwise the stored state; the gradients then equal those from the sequential state.
    for rank, r in enumerate(results):
        assert r["logps_bitwise"], f"rank {rank}"
        assert r["grads_bitwise"], f"rank {rank}: max_diff {r['grads_max_diff']:.3e}"
        assert r["grads_nonzero"] > 0


def test_wavefront_traffic_is_query_sized(results):
    # Exactly queries, partials and linear end states (formula in `_wavefront_bytes`): no K/V;
    # GLM-5 also indexer queries, top-k candidates and selections (`_glm_wavefront_bytes`), no
    # latent, rope or indexer key.
    for rank, r in enumerate(results):
        assert r["wavefront_bytes"] == r["wavefront_bytes_formula"], f"rank {rank}"


@pytest.mark.parametrize(
    ("family", "world", "dying_rank", "how"),
    [("qwen3_5", 3, 1, "exit"), ("llama", 2, 0, "exit"), ("qwen3_5", 3, 2, "raise")],
)
def test_rank_failing_mid_wavefront_fails_the_launch(
    checkpoint_dir, family, world, dying_rank, how
):
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(
            die_during_wavefront,
            world,
            str(checkpoint_dir(family)),
            dying_rank,
            how,
            timeout_s=60,
            start_method=START_METHOD,
        )
    assert info.value.rank == dying_rank
    if how == "exit":
        assert info.value.exit_code == 17
    else:
        assert "injected failure" in info.value.detail


def test_wavefront_on_sequence_subgroups_is_bitwise_the_sequential_state(checkpoint_dir):
    # 4 processes, two sequence groups of 2 with their own prompts: messages address group ranks.
    results = run_on_ranks(
        wavefront_on_subgroups, 4, str(checkpoint_dir("qwen3_5")), 2, timeout_s=120,
        start_method=START_METHOD,
    )  # fmt: skip
    assert [r["group_rank"] for r in results] == [0, 1, 0, 1]
    assert all(r["bitwise"] for r in results)


def test_attention_window_below_one_is_refused(load_tiny):
    from longstraw.distributed.wavefront_prefill import wavefront_prefill

    with pytest.raises(ValueError, match="attention_window"):
        wavefront_prefill(load_tiny("llama"), list(range(10)), shard_tokens=3, attention_window=0)
