"""GLM-5 (glm_moe_dsa) through prefill, replay and the exact sweep, against transformers' forward.

transformers' indexer picks its top-k with `Tensor.topk`, whose tie-breaking changes with the
length (random models produce many exactly-zero index scores), so a full forward and a cached
forward of transformers itself disagree in the sparse regime. The reference forwards here run
with `Tensor.topk` replaced by a stable descending sort (ties to the earlier position), the rule
LongStraw implements (`longstraw.ops.dsa_topk`); the MoE router's `torch.topk` is left alone (its
continuous sigmoid scores do not tie). The dense regime (index_topk >= length) needs no patch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dsa_reference import transformers_stable_topk

from longstraw.engine.group import accumulate_group_gradients
from longstraw.engine.prefill import prefill
from longstraw.engine.recomputed_span import RecomputedStateMismatchError
from longstraw.engine.replay import PromptCotangent, branch_logprobs
from longstraw.engine.sweep import sweep_prompt_shards
from longstraw.grpo.losses import branch_loss, sequence_weights
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig

FAMILY = "glm_moe_dsa"
SEED = 42


def _set_index_topk(model, topk: int):
    model.config.index_topk = topk
    for module in model.modules():
        if hasattr(module, "index_topk"):
            module.index_topk = topk
    return model


@pytest.fixture(scope="module")
def sparse_model(load_tiny):
    model = load_tiny(FAMILY)
    assert model.config.index_topk == 32  # the sparse regime at every test length
    return model


@pytest.fixture(scope="module")
def dense_model(load_tiny):
    return _set_index_topk(load_tiny(FAMILY), 1 << 20)


def _inputs(prompt_len, response_len, seed=SEED):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 500, (prompt_len,), generator=gen)
    response = torch.randint(0, 500, (response_len,), generator=gen)
    return prompt, response


def _full_logprobs(model, prompt, response):
    with torch.no_grad(), transformers_stable_topk():
        logits = model(torch.cat([prompt, response])[None]).logits[0]
    logp = logits.float().log_softmax(-1)[prompt.numel() - 1 : -1]
    return logp.gather(-1, response[:, None])[:, 0]


def _report(got, want):
    diff = (got - want).abs()
    return f"max_diff {diff.max().item():.3e} mean_diff {diff.mean().item():.3e}"


@pytest.mark.parametrize("regime", ["sparse", "dense"])
@pytest.mark.parametrize(
    "prompt_len,shard",
    [(63, 10), pytest.param(1000, 333, marks=pytest.mark.slow), (5, 1)],
)
def test_branch_logprobs_match_transformers_forward(
    regime, prompt_len, shard, sparse_model, dense_model
):
    model = sparse_model if regime == "sparse" else dense_model
    prompt, response = _inputs(prompt_len, 7)
    state = prefill(model, prompt, shard_tokens=shard)
    got = branch_logprobs(model, state, response)
    want = _full_logprobs(model, prompt, response)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6, msg=lambda m: _report(got, want))


def test_prefill_never_expands_the_prefix_latents(sparse_model):
    calls = []
    hooks = [
        m.kv_b_proj.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape))
        for m in sparse_model.modules()
        if hasattr(m, "kv_b_proj")
    ]
    try:
        state = prefill(sparse_model, _inputs(300, 1)[0], shard_tokens=64)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == [], f"kv_b_proj ran on {calls}: latents were decompressed"
    assert set(state.tensors()) == {"mla/latent", "mla/rope_key", "mla/indexer_key"}
    # Layer 1 is `shared`: it reuses layer 0's selection and keeps no indexer keys.
    assert state.indexer_key.shape[0] == 2


def _group(prompt_len=63, seed=SEED):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 500, (prompt_len,), generator=gen)
    responses = [torch.randint(0, 500, (n,), generator=gen) for n in (5, 9, 3)]
    return prompt, responses, torch.tensor([1.0, -0.5, 0.3])


CONFIG = GRPOConfig(loss_type="grpo", num_generations=3, max_completion_length=16)


def _longstraw_grads(model, prompt, responses, advantages, mode, shard):
    model.zero_grad(set_to_none=True)
    accumulate_group_gradients(
        model,
        prompt,
        responses,
        advantages,
        CONFIG,
        EngineConfig(shard_tokens=shard, prompt_grad=mode),
    )
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _full_sequence_grads(model, prompt, responses, advantages):
    """Plain autograd over prompt + response per branch, summed (the exact-mode reference)."""
    model.zero_grad(set_to_none=True)
    weights = sequence_weights("grpo", [r.numel() for r in responses], CONFIG)
    with transformers_stable_topk():
        for i, response in enumerate(responses):
            logits = model(torch.cat([prompt, response])[None]).logits[0]
            logp = logits[prompt.numel() - 1 : -1].float().log_softmax(-1)
            logp = logp.gather(-1, response[:, None])[:, 0]
            loss, _ = branch_loss(logp, None, float(advantages[i]), weights[i], CONFIG)
            loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _cached_path_grads(model, prompt, responses, advantages):
    """transformers' own cached path: prefill x[:-1] under no_grad, then each branch with autograd
    on a copy of that cache (its MLA/indexer layers append by torch.cat, so a copy forks it)."""
    model.zero_grad(set_to_none=True)
    weights = sequence_weights("grpo", [r.numel() for r in responses], CONFIG)
    with transformers_stable_topk():
        with torch.no_grad():
            cache = model(prompt[None, :-1], use_cache=True).cache
        for i, response in enumerate(responses):
            branch = torch.cat([prompt[-1:], response[:-1]])[None]
            logits = model(branch, cache=copy.deepcopy(cache), use_cache=True).logits[0]
            logp = logits.float().log_softmax(-1).gather(-1, response[:, None])[:, 0]
            loss, _ = branch_loss(logp, None, float(advantages[i]), weights[i], CONFIG)
            loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_grads_close(got, want, rel):
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name, ref in want.items():
        diff = (got[name] - ref).abs()
        scale = ref.abs().max().item()
        assert diff.max().item() <= rel * scale + 1e-9, (
            f"{name}: max_diff {diff.max().item():.3e} mean_diff {diff.mean().item():.3e} "
            f"(max |ref| {scale:.3e})"
        )


def _no_indexer(grads):
    """transformers runs the indexer under no_grad: its parameters get no gradient (None or 0)."""
    indexer = {n: g for n, g in grads.items() if ".indexer." in n}
    nonzero = [n for n, g in indexer.items() if g.abs().max().item() != 0.0]
    assert not nonzero, f"indexer parameters with a gradient: {nonzero}"
    return {n: g for n, g in grads.items() if n not in indexer}


@pytest.mark.parametrize("regime", ["sparse", pytest.param("dense", marks=pytest.mark.slow)])
def test_exact_gradient_matches_full_autograd_parameter_by_parameter(
    regime, sparse_model, dense_model
):
    model = sparse_model if regime == "sparse" else dense_model
    prompt, responses, advantages = _group()
    got = _no_indexer(_longstraw_grads(model, prompt, responses, advantages, "exact", 10))
    want = _no_indexer(_full_sequence_grads(model, prompt, responses, advantages))
    # Measured (P 63/1000, sparse/dense): max diff / max abs(ref) per parameter <= 1.2e-6.
    _assert_grads_close(got, want, rel=2e-5)


def test_detached_gradient_matches_transformers_cached_path(sparse_model):
    prompt, responses, advantages = _group()
    got = _longstraw_grads(sparse_model, prompt, responses, advantages, "detached", 10)
    want = _cached_path_grads(sparse_model, prompt, responses, advantages)
    _assert_grads_close(_no_indexer(got), _no_indexer(want), rel=2e-5)


def test_sweep_rejects_a_state_from_other_weights(sparse_model):
    prompt, _, _ = _group()
    state = prefill(sparse_model, prompt, shard_tokens=20)
    state.latent[1, 25] += 1e-3
    with pytest.raises(RecomputedStateMismatchError, match="latent"):
        sweep_prompt_shards(sparse_model, state, PromptCotangent.zeros_like_state(state))


def _max_saved_numel(model, prompt_len):
    prompt, response = _inputs(prompt_len, 9)
    state = prefill(model, prompt, shard_tokens=256)
    cotangent = PromptCotangent.zeros_like_state(state)
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp = branch_logprobs(model, state, response, cotangent=cotangent)
    logp.sum().backward()
    model.zero_grad(set_to_none=True)
    return max(sizes)


def test_replay_saves_no_prompt_sized_tensor(sparse_model):
    small, large = _max_saved_numel(sparse_model, 200), _max_saved_numel(sparse_model, 1500)
    assert small == large, f"largest saved tensor grows with the prompt: {small} -> {large}"


def test_decoding_with_a_kept_branch_matches_one_replay(sparse_model):
    from longstraw.engine.replay import branch_cache, replay_logits

    prompt, _ = _inputs(63, 1)
    ids = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(SEED))
    state = prefill(sparse_model, prompt, shard_tokens=10)
    with torch.no_grad():
        whole = replay_logits(sparse_model, state, ids, branch_cache(state).cache)
        cache = branch_cache(state, keep_branch=True).cache
        steps = [replay_logits(sparse_model, state, ids[:, :5], cache)]
        cache.position_offset += 5
        for i in range(5, 9):
            steps.append(replay_logits(sparse_model, state, ids[:, i : i + 1], cache))
            cache.position_offset += 1
    stepped = torch.cat(steps, dim=1)
    torch.testing.assert_close(
        stepped, whole, rtol=1e-5, atol=1e-6, msg=lambda m: _report(stepped, whole)
    )
