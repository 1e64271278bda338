"""LoRA adapters (peft) through the engine: every adapter's gradient against float64 autograd
through the same peft model, log-probs against peft's own forward, the adapters disabled as the
base, and the hand-written paths that must see (or refuse) an adapter.

The engine is handed peft's `PeftModel` itself. Adapters of rank 4 on every linear layer
(`all-linear`: on the MoE families also the routed experts and routers, through peft's
parameter wrappers), both factors random (`init_lora_weights: false`), so every A and every B
has a gradient and the adapted model is not the base. Bar per adapter tensor: the one of
`test_float64_gradient.py` (max(1e-4, 10 x transformers' own fp32 error against the truth)).

Measured (fp32; the largest relative error of any adapter tensor, exact / detached): llama
1.7e-6 / 2.4e-6, qwen3_5 8.5e-6 / 1.2e-5, qwen3_next 3.3e-6 / 2.4e-6, glm_moe_dsa 1.8e-6 /
1.6e-6. Before `kv_b_weight`, GLM-5's absorbed attention read `kv_b_proj`'s base weight and
the kv_b_proj adapters' gradients had relative error 1.0 (and every other tensor's too, once B
was not zero).
"""

from __future__ import annotations

import pytest
import torch
from dsa_reference import transformers_stable_topk
from engine_helpers import (
    FP32_ATOL,
    FP32_RTOL,
    assert_close,
    assert_grads_close,
    full_sequence_logprobs,
    random_group,
    reference_group_gradient,
    stock_cached_branch_logprobs,
    stock_prefilled_cache,
    take_grads,
    vocab_of,
    zero_grads,
)
from float64_reference import assert_within_transformers_bar, float64_comparison

from longstraw.engine import sweep
from longstraw.engine.group import GradBuffer, accumulate_group_gradients
from longstraw.engine.prefill import prefill
from longstraw.engine.rollout import SamplingParams, sample_responses, score_responses
from longstraw.grpo.losses import branch_loss, sequence_weights
from longstraw.models.lora import adapter_dropout_training, unwrapped, with_lora
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig, LoraConfig

FAMILIES = ("llama", "qwen3_5", "qwen3_next", "glm_moe_dsa")
PROMPT_LEN = 101
SHARD_TOKENS = 30
# Sweep blocks of 24 tokens: several per shard, not aligned with the delta rule's 64-token chunks.
SWEEP_BLOCK_TOKENS = 24
RESPONSE_LENS = (9, 4, 13)
# bf16 log-probs against peft's bf16 forward: docs/design.md's bf16 tolerance, as rtol and atol
# (log-probs near -6). Measured max |diff|: llama 4.3e-3, qwen3_5 6.7e-3, qwen3_next 7.8e-3,
# glm_moe_dsa 1.9e-2 (its absorbed attention rounds in another order than transformers'
# expansion); fp32 at most 9.5e-7.
BF16_LOGP_TOL = 2e-2


def peft_logprobs(model, prompt, response, *, temperature: float = 1.0) -> torch.Tensor:
    """[R] log-probs from peft's own forward over prompt + response (GLM-5's DSA held to the
    stable top-k tie rule, as every GLM-5 comparison is: `dsa_reference`)."""
    with torch.no_grad(), transformers_stable_topk():
        return full_sequence_logprobs(model, prompt, response, temperature=temperature)


def random_adapters(
    model, targets="all-linear", *, dropout: float = 0.0, init=False, dtype=torch.float32
):
    """`model` wrapped by peft with rank-4 adapters on `targets`, both factors random."""
    settings = LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout, init_lora_weights=init
    )
    return with_lora(model, settings, seed=7)


@pytest.fixture(scope="module")
def lora_model(load_tiny):
    """`lora_model(family, targets="all-linear", dtype=fp32)` -> a peft model over a fresh tiny
    checkpoint with random adapters; one per key for the module, gradients cleared per use."""
    built = {}

    def get(family, targets="all-linear", dtype=torch.float32):
        key = (family, targets if isinstance(targets, str) else tuple(targets), dtype)
        if key not in built:
            built[key] = random_adapters(load_tiny(family, dtype), targets)
        zero_grads(built[key])
        return built[key]

    return get


def _check_against_float64(model, prompt_grad, monkeypatch):
    monkeypatch.setattr(sweep, "SWEEP_BLOCK_TOKENS", SWEEP_BLOCK_TOKENS)
    cfg = GRPOConfig(loss_type="grpo")
    prompt, responses, advantages = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    ours, transformers32, truth = float64_comparison(
        model,
        prompt,
        responses,
        advantages,
        cfg,
        prompt_grad=prompt_grad,
        shard_tokens=SHARD_TOKENS,
    )
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters), sorted(adapters)
    assert set(ours) == adapters, "the buffer holds the adapters' gradients and nothing else"
    assert all(p.grad is None for p in model.parameters()), "a buffer was given: .grad untouched"
    # GLM-5's DSA indexer runs under no_grad in transformers too: its adapters get no gradient.
    silent = {n for n in adapters if float(truth[n].abs().max()) == 0}
    assert all(".indexer." in n for n in silent), sorted(silent)
    family = model.config.model_type
    return assert_within_transformers_bar(
        ours, transformers32, truth, what=f"LoRA {family} {prompt_grad} vs float64"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_exact_gradient_matches_float64_autograd_per_adapter(lora_model, family, monkeypatch):
    _check_against_float64(lora_model(family), "exact", monkeypatch)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_detached_gradient_matches_float64_cached_path_per_adapter(
    lora_model, family, monkeypatch
):
    _check_against_float64(lora_model(family), "detached", monkeypatch)


# Adapters on a gated MLP: the sweep's blockwise backward takes plain projections and peft's
# `lora.Linear` ones (their low-rank path included) by hand (`engine.sweep._gated_mlp_split`).
PARTIAL_TARGETS = {
    # MLP untouched: all three projections by hand, their (frozen) weights get no gradient.
    "attention": (("q_proj", "k_proj", "v_proj", "o_proj"), (False, False, False)),
    # gate / up adapted: their adapters by hand beside the frozen down projection.
    "gate_up": (("q_proj", "v_proj", "gate_proj", "up_proj"), (True, True, False)),
    # every projection adapted (`all-linear`).
    "all": ("all-linear", (True, True, True)),
}


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3_5", marks=pytest.mark.slow)])
@pytest.mark.parametrize("targets", sorted(PARTIAL_TARGETS))
def test_mlp_adapters_are_taken_by_hand_in_the_sweep(lora_model, family, targets, monkeypatch):
    names, adapted = PARTIAL_TARGETS[targets]
    model = lora_model(family, names if isinstance(names, str) else list(names))
    for layer in unwrapped(model).model.layers:
        split = sweep._gated_mlp_split(layer.mlp)
        assert type(split).__name__ == "GatedMlp", split
        assert tuple(lr is not None for lr in split.low_rank) == adapted
        assert not any(p.weight.requires_grad for p in (split.gate, split.up, split.down))
    _check_against_float64(model, "exact", monkeypatch)


def _logprob_cases():
    for family in FAMILIES:
        yield pytest.param(family, torch.float32, id=f"fp32-{family}")
        # bf16: the hybrid and GLM-5 in the quick suite, the other two with the slow tests.
        slow = () if family in ("qwen3_5", "glm_moe_dsa") else (pytest.mark.slow,)
        yield pytest.param(family, torch.bfloat16, marks=slow, id=f"bf16-{family}")


@pytest.mark.parametrize(("family", "dtype"), _logprob_cases())
def test_lora_logprobs_match_peft_forward(lora_model, family, dtype):
    model = lora_model(family, dtype=dtype)
    prompt, responses, _ = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    state = prefill(model, prompt, shard_tokens=SHARD_TOKENS)
    actual = score_responses(model, state, responses)
    expected = [peft_logprobs(model, prompt, r) for r in responses]
    for a, e in zip(actual, expected, strict=True):
        if dtype == torch.float32:
            assert_close(a, e, what=f"{family} fp32", rtol=FP32_RTOL, atol=FP32_ATOL)
        else:
            assert_close(a, e, what=f"{family} bf16", rtol=BF16_LOGP_TOL, atol=BF16_LOGP_TOL)


@pytest.mark.parametrize(
    "family",
    [
        "qwen3_5",
        "glm_moe_dsa",
        *(pytest.param(f, marks=pytest.mark.slow) for f in ("llama", "qwen3_next")),
    ],
)
def test_sampled_logprobs_with_adapters_match_peft_forward(lora_model, family):
    """Rollout decodes with the adapters: its sampler log-probs are peft's forward's."""
    model = lora_model(family)
    prompt, _, _ = random_group(PROMPT_LEN, (1,), vocab_of(model))
    state = prefill(model, prompt, shard_tokens=SHARD_TOKENS)
    params = SamplingParams(num_samples=3, max_new_tokens=6, temperature=0.8)
    responses = sample_responses(model, state, params, generator=torch.Generator().manual_seed(3))
    for row, response in enumerate(responses):
        ids = torch.tensor(response.token_ids)
        expected = peft_logprobs(model, prompt, ids, temperature=0.8)
        assert_close(
            torch.tensor(response.logprobs),
            expected,
            what=f"{family} row {row}",
            rtol=FP32_RTOL,
            atol=FP32_ATOL,
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_disabled_score_exactly_the_separately_loaded_base(lora_model, load_tiny, family):
    """The KL reference of a LoRA run: the same module with peft's adapters disabled is the
    base, bit for bit (prefill and scoring), while enabled it is not."""
    model = lora_model(family)
    base = load_tiny(family)
    prompt, responses, _ = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    expected = score_responses(base, prefill(base, prompt, shard_tokens=SHARD_TOKENS), responses)
    with model.disable_adapter():
        disabled = score_responses(
            model, prefill(model, prompt, shard_tokens=SHARD_TOKENS), responses
        )
    enabled = score_responses(model, prefill(model, prompt, shard_tokens=SHARD_TOKENS), responses)
    for d, e, a in zip(disabled, expected, enabled, strict=True):
        assert torch.equal(d, e), f"{family}: adapters disabled differ from the base"
        assert not torch.allclose(a, e), f"{family}: the adapters change nothing (vacuous)"


class _ScaledLinear(torch.nn.Linear):
    """A linear layer whose forward is not its weight's alone: what a hand-written path reading
    `.weight` would silently get wrong."""

    def forward(self, x):
        return 2.0 * super().forward(x)


def test_unknown_linear_wrapper_on_glm_kv_b_proj_fails_loudly(load_tiny):
    model = load_tiny("glm_moe_dsa")
    attention = model.model.layers[1].self_attn
    old = attention.kv_b_proj
    attention.kv_b_proj = _ScaledLinear(old.in_features, old.out_features, bias=False)
    prompt, _, _ = random_group(40, (1,), vocab_of(model))
    with pytest.raises(RuntimeError, match=r"kv_b_proj.*_ScaledLinear"):
        prefill(model, prompt, shard_tokens=SHARD_TOKENS)


def test_unknown_linear_wrapper_in_a_gated_mlp_is_differentiated_by_autograd():
    """The sweep's MLP backward takes by hand only exact `nn.Linear` projections (and peft's
    adapters on them): a subclass is left to autograd, so what its forward adds is
    differentiated too."""

    class Mlp(torch.nn.Module):
        def __init__(self, down):
            super().__init__()
            self.gate_proj = torch.nn.Linear(4, 8, bias=False)
            self.up_proj = torch.nn.Linear(4, 8, bias=False)
            self.down_proj = down
            self.act_fn = torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    assert type(sweep._gated_mlp_split(Mlp(torch.nn.Linear(8, 4, bias=False)))).__name__ == (
        "GatedMlp"
    )
    assert sweep._gated_mlp_split(Mlp(_ScaledLinear(8, 4, bias=False))) is None


def test_exact_mode_refuses_adapter_dropout(load_tiny):
    model = random_adapters(load_tiny("llama"), dropout=0.1)
    prompt, responses, advantages = random_group(40, (3, 2), vocab_of(model))
    with pytest.raises(ValueError, match=r"dropout.*prompt_grad exact"):
        accumulate_group_gradients(
            model, prompt, responses, advantages, GRPOConfig(), EngineConfig(prompt_grad="exact")
        )
    with pytest.raises(ValueError, match=r"dropout.*branch_segment_tokens 2"):
        accumulate_group_gradients(
            model,
            prompt,
            responses,
            advantages,
            GRPOConfig(),
            EngineConfig(prompt_grad="detached", branch_segment_tokens=2),
        )


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_detached_adapter_dropout_matches_the_cached_path_with_the_same_masks(load_tiny, family):
    """Detached mode with `lora_dropout`: the masks are drawn in the differentiated branch
    forward (prefill and scoring draw none), as in transformers' cached path run with the
    adapters' dropout in training mode for the branch; the same seed gives the same masks."""
    model = random_adapters(load_tiny(family), dropout=0.3)
    cfg = GRPOConfig(loss_type="grpo")
    prompt, responses, advantages = random_group(60, (5, 3, 7), vocab_of(model))
    weights = sequence_weights(cfg.loss_type, [r.numel() for r in responses], cfg)

    def reference():
        torch.manual_seed(11)
        zero_grads(model)
        for i, response in enumerate(responses):
            cache = stock_prefilled_cache(model, prompt)
            with adapter_dropout_training(model):
                logp = stock_cached_branch_logprobs(model, prompt, response, cache=cache)
            branch_loss(logp, None, float(advantages[i]), weights[i], cfg)[0].backward()
        return take_grads(model)

    expected = reference()
    without_dropout = reference_group_gradient(
        model, prompt, responses, advantages, cfg, path="cached"
    )
    torch.manual_seed(11)
    buffer = GradBuffer(model)
    accumulate_group_gradients(
        model,
        prompt,
        responses,
        advantages,
        cfg,
        EngineConfig(shard_tokens=17, prompt_grad="detached"),
        grad_buffer=buffer,
    )
    assert_grads_close(buffer.grads, expected, what=f"{family} detached with dropout")
    moved = max(float((expected[n] - without_dropout[n]).abs().max()) for n in expected) / max(
        float(g.abs().max()) for g in expected.values()
    )
    assert moved > 1e-2, f"dropout changed the gradient by {moved:.1e} only: the test is vacuous"


@pytest.mark.parametrize("family", ["qwen3_5", "glm_moe_dsa"])
def test_segments_shared_prefixes_and_a_state_budget_give_the_lora_gradient(
    lora_model, family, tmp_path
):
    """The engine's other replay paths with adapters: segments of 3 tokens, responses sharing
    their first tokens run as a prefix tree, and the state streamed from disk under a budget of
    0 give the plain exact gradient of every adapter (the same function in another fp32 order;
    the budget moves only data, and is bitwise)."""
    model = lora_model(family)
    cfg = GRPOConfig(loss_type="grpo")
    prompt, responses, advantages = random_group(61, (7, 5, 9), vocab_of(model))
    responses[1] = torch.cat([responses[0][:3], responses[1][3:]])  # a shared first turn

    def exact(**options):
        buffer = GradBuffer(model)
        accumulate_group_gradients(
            model, prompt, responses, advantages, cfg,
            EngineConfig(shard_tokens=20, prompt_grad="exact", **options), grad_buffer=buffer,
        )  # fmt: skip
        return buffer.grads

    plain = exact()
    assert_grads_close(exact(branch_segment_tokens=3), plain, what=f"{family} segments")
    assert_grads_close(exact(share_response_prefixes=True), plain, what=f"{family} prefix tree")
    tiered = exact(state_budget_bytes=0, state_tier="disk", state_dir=str(tmp_path))
    assert all(torch.equal(tiered[n], g) for n, g in plain.items()), f"{family} budget 0"
