"""A PrefixState passed in is used as is; GroupStats reports what happened; an interrupted
prefill resumes at the first missing shard and reproduces the uninterrupted state bitwise."""

from __future__ import annotations

import importlib

import pytest
import torch
from engine_helpers import ENGINE_FAMILIES, random_group, take_grads, vocab_of

from longstraw.engine.group import accumulate_group_gradients
from longstraw.engine.prefill import prefill
from longstraw.engine.replay import branch_logprobs
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig

# By module path: `import longstraw.engine.prefill as m` could bind a re-exported function.
group_module = importlib.import_module("longstraw.engine.group")
prefill_module = importlib.import_module("longstraw.engine.prefill")


def _count_calls(monkeypatch, module, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
def test_a_prefix_state_passed_in_is_used_without_a_second_prefill(
    tiny_model, monkeypatch, prompt_grad
):
    model = tiny_model("qwen3_5")
    cfg = GRPOConfig(loss_type="grpo")
    prompt, responses, advantages = random_group(97, (5, 9, 2), vocab_of(model))
    state = prefill(model, prompt, shard_tokens=30)
    prefills = _count_calls(monkeypatch, group_module, "prefill")

    from_state = accumulate_group_gradients(
        model,
        state,
        responses,
        advantages,
        cfg,
        EngineConfig(shard_tokens=30, prompt_grad=prompt_grad),
    )
    grads_from_state = take_grads(model)
    assert prefills == [], "a PrefixState was passed, yet the prompt was prefilled again"
    assert from_state.seconds.prefill == 0.0

    from_ids = accumulate_group_gradients(
        model,
        prompt,
        responses,
        advantages,
        cfg,
        EngineConfig(shard_tokens=30, prompt_grad=prompt_grad),
    )
    assert prefills == [1]
    assert from_ids.seconds.prefill > 0.0
    # Same state either way: bitwise the same gradient and log-probs.
    for name, grad in take_grads(model).items():
        assert torch.equal(grad, grads_from_state[name]), name
    assert from_ids.branch_logprobs == from_state.branch_logprobs


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
def test_group_stats_report_timings_token_counts_and_bytes(tiny_model, prompt_grad):
    model = tiny_model("qwen3_next")
    cfg = GRPOConfig(loss_type="dapo")
    prompt, responses, advantages = random_group(97, (5, 9, 2), vocab_of(model))
    masks = [torch.ones(5), torch.tensor([1.0, 1, 0, 0, 1, 1, 1, 0, 1]), torch.ones(2)]
    stats = accumulate_group_gradients(
        model,
        prompt,
        responses,
        advantages,
        cfg,
        EngineConfig(shard_tokens=30, prompt_grad=prompt_grad),
        loss_masks=masks,
    )
    take_grads(model)
    state = prefill(model, prompt, shard_tokens=30)

    assert stats.prompt_grad == prompt_grad
    assert stats.prompt_tokens == 97 and stats.num_shards == 4  # 96 = 3 * 30 + 6
    assert stats.num_tokens == [5, 6, 2]
    assert [len(lp) for lp in stats.branch_logprobs] == [5, 9, 2]
    with torch.no_grad():
        for response, reported in zip(responses, stats.branch_logprobs, strict=True):
            assert torch.equal(branch_logprobs(model, state, response), torch.tensor(reported))
    assert len(stats.branch_losses) == 3
    assert stats.loss == pytest.approx(sum(stats.branch_losses), rel=1e-12)
    assert stats.seconds.prefill > 0 and stats.seconds.replay > 0
    assert (stats.seconds.sweep > 0) == (prompt_grad == "exact")
    assert stats.state_bytes == state.state_bytes() > 0
    assert stats.checkpoint_bytes == state.checkpoint_bytes() > 0
    assert (stats.cotangent_bytes > stats.state_bytes) == (prompt_grad == "exact")
    assert stats.peak_rss_bytes > 0 and stats.peak_device_bytes is None
    assert stats.kl is None  # beta = 0


class _Crash(RuntimeError):
    pass


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_resumed_prefill_is_bitwise_equal_to_an_uninterrupted_one(tiny_model, monkeypatch, family):
    model = tiny_model(family)
    prompt, _, _ = random_group(131, (1,), vocab_of(model))  # T = 130 = 6 * 20 + 10: 7 shards
    uninterrupted = prefill(model, prompt, shard_tokens=20)

    partial = {}

    def crash_after_shard_2(state, shard):
        partial["state"] = state
        if shard == 2:
            raise _Crash(f"simulated crash after shard {shard}")

    with pytest.raises(_Crash):
        prefill(model, prompt, shard_tokens=20, on_shard=crash_after_shard_2)

    shard_forwards = _count_calls(monkeypatch, prefill_module, "run_shard_forward")
    done = []
    resumed = prefill(
        model,
        prompt,
        shard_tokens=20,
        resume=partial["state"],
        start_shard=3,
        on_shard=lambda state, shard: done.append(shard),
    )
    assert done == [3, 4, 5, 6] and len(shard_forwards) == 4, "committed shards were recomputed"
    assert resumed.tensors().keys() == uninterrupted.tensors().keys()
    for name, tensor in uninterrupted.tensors().items():
        assert torch.equal(resumed.tensors()[name], tensor), f"{name} differs after resume"


def test_resume_with_another_prompt_or_shard_size_is_rejected(tiny_model):
    model = tiny_model("llama")
    prompt, _, _ = random_group(41, (1,), vocab_of(model))
    state = prefill(model, prompt, shard_tokens=10)
    with pytest.raises(ValueError, match="another prompt or shard size"):
        prefill(model, prompt, shard_tokens=8, resume=state, start_shard=2)
    other = prompt.clone()
    other[0] = (other[0] + 1) % vocab_of(model)
    with pytest.raises(ValueError, match="another prompt or shard size"):
        prefill(model, other, shard_tokens=10, resume=state, start_shard=2)
    with pytest.raises(ValueError, match="needs the partially filled state"):
        prefill(model, prompt, shard_tokens=10, start_shard=2)
