"""A tiered prompt state (resident budget, the rest streamed chunk by chunk) against the resident one.

Reference: the same engine on the fully resident state. Same kernels on the same values in the
same order, so log-probs, rollout tokens and gradients must be bitwise equal, and the store's
own count of device-resident bytes must stay within max(budget, one chunk unit) + one chunk
unit (a chunk unit: one chunk of every streamed array of a layer, cotangents included).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import random_group, take_grads, vocab_of

from longstraw.engine import attention
from longstraw.engine.group import accumulate_group_gradients
from longstraw.engine.prefill import prefill
from longstraw.engine.replay import branch_logprobs
from longstraw.engine.rollout import SamplingParams, sample_responses
from longstraw.engine.state_tiers import tier_state
from longstraw.models import glm
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig

# Full attention, the Qwen3.5 hybrid (Gated DeltaNet + full attention), GLM-5 MLA + DSA.
FAMILIES = ("llama", "qwen3_5", "glm_moe_dsa")
PROMPT_LEN = 41
SHARD_TOKENS = 16  # T = 40: shards 16/16/8
RESPONSE_LENS = (5, 7)
# The kernels' prefix chunk, for the resident and the tiered run alike: T = 40 is 4 chunks
# (12/12/12/4), and the sweep's prefixes (16, 32) end inside a chunk.
CHUNK_TOKENS = 12


@pytest.fixture
def small_chunks(monkeypatch):
    """Attention kernels (and so the streamed unit) on a 12-row prefix grid."""
    monkeypatch.setattr(attention, "PREFIX_CHUNK_TOKENS", CHUNK_TOKENS)
    monkeypatch.setattr(glm, "PREFIX_CHUNK_TOKENS", CHUNK_TOKENS)


def _layer_bytes(tiered) -> int:
    return max(tiered.store.unit_bytes.values())


def _budgets(tiered_probe) -> dict[str, int]:
    """Zero (nothing kept: one chunk of each array streamed at a time, one prefetched), two
    chunk units (below one layer's state), and two layers plus a chunk unit (two kept for good,
    the rest streamed)."""
    unit, chunk = _layer_bytes(tiered_probe), tiered_probe.store.chunk_unit_bytes
    assert 2 * chunk < unit  # the grid really cuts a layer
    return {"zero": 0, "below_one_layer": 2 * chunk, "two_layers": 2 * unit + chunk}


def _assert_within_budget(tiered, budget: int) -> None:
    store = tiered.store
    chunk = store.chunk_unit_bytes
    assert store.peak_resident_bytes <= max(budget, chunk) + chunk, (
        f"peak resident {store.peak_resident_bytes} > max(budget {budget}, chunk unit {chunk})"
        f" + {chunk}"
    )
    if budget < _layer_bytes(tiered):
        # Chunks within a layer: never a whole layer's state on the device at once.
        assert store.peak_resident_bytes < _layer_bytes(tiered)
    assert store.bytes_read > 0  # the state really was streamed from the lower tier


def _grads(model, state, prompt_grad, responses, advantages):
    cfg = GRPOConfig(loss_type="grpo")
    stats = accumulate_group_gradients(
        model,
        state,
        responses,
        advantages,
        cfg,
        EngineConfig(shard_tokens=SHARD_TOKENS, prompt_grad=prompt_grad),
    )
    return take_grads(model), stats.branch_logprobs


def _assert_bitwise(actual: dict, expected: dict, what: str) -> None:
    for name, grad in expected.items():
        assert torch.equal(actual[name], grad), (
            f"{what}: {name} differs (max_diff {(actual[name] - grad).abs().max().item():.3e})"
        )


# Exact mode read-modify-writes dS in the scratch file; detached streams from host memory.
@pytest.mark.parametrize(("prompt_grad", "lower"), [("exact", "disk"), ("detached", "host")])
@pytest.mark.parametrize("family", FAMILIES)
def test_tiered_state_gives_bitwise_equal_gradients(
    tiny_model, tmp_path, small_chunks, family, prompt_grad, lower
):
    model = tiny_model(family)
    prompt, responses, advantages = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    state = prefill(model, prompt, shard_tokens=SHARD_TOKENS)
    expected, expected_logps = _grads(model, state, prompt_grad, responses, advantages)
    with tier_state(model, state, budget_bytes=0, exact=prompt_grad == "exact") as probe:
        budgets = _budgets(probe)
    for label, budget in budgets.items():
        with tier_state(
            model,
            state,
            budget_bytes=budget,
            lower=lower,
            directory=str(tmp_path),
            exact=prompt_grad == "exact",
        ) as tiered:
            actual, logps = _grads(model, tiered.state, prompt_grad, responses, advantages)
            _assert_within_budget(tiered, budget)
            if label in ("zero", "below_one_layer"):
                assert not tiered.store.permanent
                assert tiered.store.bytes_written > 0 or prompt_grad == "detached"
            if label == "two_layers":
                # Two kept, with room for one working chunk unit streaming the rest.
                assert len(tiered.store.permanent) == min(2, len(tiered.store.unit_bytes))
        assert logps == expected_logps, f"{family}/{prompt_grad}/{label}: log-probs differ"
        _assert_bitwise(actual, expected, f"{family}/{prompt_grad}/{lower}/{label}")
    assert not list(tmp_path.iterdir()), "scratch files left behind"


@pytest.mark.parametrize("family", FAMILIES)
def test_tiered_state_gives_the_same_rollout_and_logprobs(tiny_model, small_chunks, family):
    model = tiny_model(family)
    prompt, responses, _ = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    state = prefill(model, prompt, shard_tokens=SHARD_TOKENS)
    params = SamplingParams(num_samples=3, max_new_tokens=6, temperature=0.9)
    with torch.no_grad():
        expected = sample_responses(
            model, state, params, generator=torch.Generator().manual_seed(42)
        )
        expected_logp = branch_logprobs(model, state, responses[0])
        with tier_state(model, state, budget_bytes=0, exact=False) as tiered:
            actual = sample_responses(
                model, tiered.state, params, generator=torch.Generator().manual_seed(42)
            )
            actual_logp = branch_logprobs(model, tiered.state, responses[0])
            _assert_within_budget(tiered, 0)
            # Every decoding step reads the layers ahead of their use on the prefetch thread.
            assert tiered.store.prefetches >= params.max_new_tokens
    assert [r.token_ids for r in actual] == [r.token_ids for r in expected]
    assert [r.logprobs for r in actual] == [r.logprobs for r in expected]
    assert torch.equal(actual_logp, expected_logp)


def test_tiered_state_rejects_a_negative_budget(tiny_model):
    model = tiny_model("llama")
    state = prefill(model, torch.arange(9), shard_tokens=4)
    with pytest.raises(ValueError, match="state_budget_bytes must be >= 0"):
        tier_state(model, state, budget_bytes=-1)


def _persisted(model, tmp_path, family):
    """A committed Zarr state of a random prompt, and the prompt."""
    from longstraw.schemas.storage import StateKey, StorageConfig
    from longstraw.training.persisted_prefill import persisted_prefill
    from longstraw.training.prompts import prompt_digest

    prompt, responses, advantages = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    storage = StorageConfig(root_uri=str(tmp_path / "states"))
    key = StateKey.policy(family, 0, "w", prompt_digest(prompt))
    state, outcome = persisted_prefill(
        model, prompt, shard_tokens=SHARD_TOKENS, storage=storage, key=key
    )
    return state, outcome.ref, storage, prompt, responses, advantages


@pytest.mark.parametrize("family", ["qwen3_5", "glm_moe_dsa"])
def test_replay_streams_from_the_committed_state_with_bitwise_equal_gradients(
    tiny_model, tmp_path, small_chunks, family
):
    from longstraw.storage.streamed_state import open_streamed_state
    from longstraw.training.streamed_state import tier_committed_state

    model = tiny_model(family)
    state, ref, storage, prompt, responses, advantages = _persisted(model, tmp_path, family)
    expected, expected_logps = _grads(model, state, "exact", responses, advantages)
    streamed = open_streamed_state(
        ref, expect_weights_digest="w", expect_policy_version=0, config=storage
    )
    tiers = [tier for tier, _, _ in streamed.token_tiers.values()]
    assert sum(t.chunks_read for t in tiers) == 0  # opening reads no per-token chunk
    with tier_committed_state(
        model, streamed, prompt, budget_bytes=0, lower="disk", directory=str(tmp_path)
    ) as tiered:
        actual, logps = _grads(model, tiered.state, "exact", responses, advantages)
        _assert_within_budget(tiered, 0)
    assert logps == expected_logps
    _assert_bitwise(actual, expected, f"{family} streamed from Zarr")
    assert all(t.chunks_read > 0 for t in tiers)


def test_a_flipped_byte_is_detected_when_its_chunk_is_streamed(tiny_model, tmp_path):
    from longstraw.storage import ChunkChecksumError
    from longstraw.storage.codec import chunk_key
    from longstraw.storage.paths import ZARR_NAME, attempt_dir_name
    from longstraw.storage.reader import read_manifest
    from longstraw.storage.streamed_state import open_streamed_state
    from longstraw.training.streamed_state import tier_committed_state

    model = tiny_model("llama")
    _, ref, storage, prompt, responses, _ = _persisted(model, tmp_path, "llama")
    manifest, _ = read_manifest(ref, storage)
    shard = manifest.shards[1]
    victim = next(d for d in shard.chunks if d.array == "full_attention/v")
    path = (
        f"{ref.uri.removeprefix('file://')}/{attempt_dir_name(shard.attempt_id)}/{ZARR_NAME}/"
        f"{chunk_key(victim.array, victim.index)}"
    )
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x01
        f.seek(0)
        f.write(bytes(data))
    # Opening touches no per-token chunk, so it succeeds; the first read of the chunk fails.
    streamed = open_streamed_state(
        ref, expect_weights_digest="w", expect_policy_version=0, config=storage
    )
    with (
        tier_committed_state(model, streamed, prompt, budget_bytes=0, exact=False) as tiered,
        pytest.raises(ChunkChecksumError) as err,
        torch.no_grad(),
    ):
        branch_logprobs(model, tiered.state, responses[0])
    assert (err.value.array, tuple(err.value.index)) == (victim.array, tuple(victim.index))


def test_group_gradients_with_a_state_budget_match_the_resident_ones(
    tiny_model, tmp_path, small_chunks
):
    """The `engine.state_budget_bytes` path: accumulate_group_gradients tiers the state itself."""
    model = tiny_model("qwen3_5")
    prompt, responses, advantages = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    cfg = GRPOConfig(loss_type="dapo")
    runs = []
    for budget in (None, 0):
        stats = accumulate_group_gradients(
            model,
            prompt,
            responses,
            advantages,
            cfg,
            EngineConfig(
                shard_tokens=SHARD_TOKENS,
                prompt_grad="detached",
                state_budget_bytes=budget,
                state_tier="disk",
                state_dir=str(tmp_path),
            ),
        )
        runs.append((take_grads(model), stats.branch_logprobs))
    assert runs[1][1] == runs[0][1]
    _assert_bitwise(runs[1][0], runs[0][0], "state_budget_bytes=0")
    assert not list(tmp_path.iterdir()), "scratch files left behind"


def test_a_store_grid_other_than_the_kernels_gathers_reads_and_refuses_cotangent_slices(
    tiny_model, small_chunks
):
    """Streamed in 5-row chunks while the kernels slice 12 rows: reads are gathered copies (same
    numbers), but a cotangent slice across chunks cannot be added into in place."""
    model = tiny_model("llama")
    prompt, responses, advantages = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    state = prefill(model, prompt, shard_tokens=SHARD_TOKENS)
    expected, expected_logps = _grads(model, state, "detached", responses, advantages)
    with tier_state(model, state, budget_bytes=0, exact=False, chunk_tokens=5) as tiered:
        actual, logps = _grads(model, tiered.state, "detached", responses, advantages)
    assert logps == expected_logps
    _assert_bitwise(actual, expected, "5-row store grid")
    with (
        tier_state(model, state, budget_bytes=0, chunk_tokens=5) as tiered,
        pytest.raises(IndexError, match="a cotangent is added into one chunk"),
    ):
        _grads(model, tiered.state, "exact", responses, advantages)
