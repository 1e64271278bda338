"""Model gradients against a float64 truth: the same weights, every operation in float64
(`tests/float64.py` says why `model.double()` alone is not that).

Criterion (per parameter tensor): LongStraw's fp32 relative error ||g - g64|| / ||g64|| must be at
most max(1e-4, 10 x transformers' own fp32 relative error on that parameter). For the Gated
DeltaNet families transformers has two fp32 kernels, the chunked one its layers call and the
per-token recurrence (`transformers_recurrent_delta_rule`); the bar takes the better of the two.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator, Sequence

import torch
from dsa_reference import transformers_stable_topk
from engine_helpers import reference_group_gradient
from float64 import float64_computation, relative_errors

from longstraw.engine.group import GradBuffer, accumulate_group_gradients
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig

REL_FLOOR = 1e-4
TIMES_TRANSFORMERS = 10.0


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights in float64; MoE experts on transformers' eager path (grouped_mm has no
    float64)."""
    model64 = copy.deepcopy(model).double()
    if getattr(model64, "_can_set_experts_implementation", lambda: False)():
        model64.set_experts_implementation("eager")
    return model64


@contextlib.contextmanager
def transformers_recurrent_delta_rule(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, `model`'s Gated DeltaNet layers run transformers' per-token recurrence
    (`torch_recurrent_gated_delta_rule`) where they would call its chunked kernel."""
    modules = {
        sys.modules[type(m).__module__]
        for m in model.modules()
        if hasattr(m, "A_log") and hasattr(m, "dt_bias")
    }
    saved = {module: module.torch_chunk_gated_delta_rule for module in modules}

    def recurrent_of(module):
        def recurrent(*args, chunk_size=64, **kwargs):
            return module.torch_recurrent_gated_delta_rule(*args, **kwargs)

        return recurrent

    for module in modules:
        module.torch_chunk_gated_delta_rule = recurrent_of(module)
    try:
        yield
    finally:
        for module, original in saved.items():
            module.torch_chunk_gated_delta_rule = original


def assert_within_transformers_bar(
    longstraw: dict[str, torch.Tensor],
    transformers32: list[dict[str, torch.Tensor]],
    truth: dict[str, torch.Tensor],
    *,
    what: str,
) -> dict[str, tuple[float, float]]:
    """Per parameter: rel(longstraw) <= max(1e-4, 10 x rel(transformers)), all against the
    float64 `truth`, rel(transformers) the smallest over `transformers32` (its fp32 gradients by
    its different kernels). Returns {name: (longstraw rel, transformers rel)}."""
    assert max(float(g.abs().max()) for g in truth.values()) > 0, "all-zero truth checks nothing"
    ours = relative_errors(longstraw, truth)
    per_kernel = [relative_errors(grads, truth) for grads in transformers32]
    theirs = {name: min(errors[name] for errors in per_kernel) for name in truth}
    failures = []
    for name, err in ours.items():
        bar = max(REL_FLOOR, TIMES_TRANSFORMERS * theirs[name])
        if not err <= bar:
            diff = (longstraw[name].double() - truth[name].double()).abs()
            failures.append(
                f"{name}: rel {err:.3e} > bar {bar:.3e} (transformers fp32 rel {theirs[name]:.3e}) "
                f"max_diff={diff.max().item():.3e} mean_diff={diff.mean().item():.3e} "
                f"|truth|={truth[name].double().norm().item():.3e}"
            )
    assert not failures, f"{what}:\n" + "\n".join(failures)
    return {name: (ours[name], theirs[name]) for name in ours}


def is_hybrid(model: torch.nn.Module) -> bool:
    return any(hasattr(m, "A_log") for m in model.modules())


def is_glm_model(model: torch.nn.Module) -> bool:
    return model.config.model_type == "glm_moe_dsa"


def float64_comparison(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    responses: Sequence[torch.Tensor],
    advantages: torch.Tensor,
    cfg: GRPOConfig,
    *,
    prompt_grad: str,
    shard_tokens: int,
    model64: torch.nn.Module | None = None,
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(LongStraw's gradient, transformers' gradients by kernel, the float64 truth) of one group.

    Exact mode is compared with full-sequence autograd, detached mode with transformers' cached
    path (`engine_helpers.reference_group_gradient`); LongStraw's gradient is accumulated in fp32
    (`GradBuffer`) whatever the model dtype, transformers' in the model dtype, as its autograd
    does. `model64`: `float64_copy(model)`, made here if not given.
    """
    path = "full" if prompt_grad == "exact" else "cached"
    if model64 is None:
        model64 = float64_copy(model)
    selection = transformers_stable_topk if is_glm_model(model) else contextlib.nullcontext
    with float64_computation(), selection():
        truth = reference_group_gradient(model64, prompt, responses, advantages, cfg, path=path)
    with selection():
        transformers32 = [
            reference_group_gradient(model, prompt, responses, advantages, cfg, path=path)
        ]
        if is_hybrid(model):
            with transformers_recurrent_delta_rule(model):
                transformers32.append(
                    reference_group_gradient(model, prompt, responses, advantages, cfg, path=path)
                )
    buffer = GradBuffer(model)
    accumulate_group_gradients(
        model,
        prompt,
        responses,
        advantages,
        cfg,
        EngineConfig(shard_tokens=shard_tokens, prompt_grad=prompt_grad),
        grad_buffer=buffer,
    )
    return buffer.grads, transformers32, truth
