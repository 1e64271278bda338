"""PolicyOptimizer: AdamW on fp32 masters fed from fp32 gradient buffers, clipping, warm-up,
and a safetensors round trip of its state."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from longstraw.engine.group import GradBuffer
from longstraw.grpo.optim import PolicyOptimizer, warmup_factor
from longstraw.schemas.grpo import GRPOConfig

SEED = 42


def random_grads(model, *, seed: int, scale: float = 1e-2) -> GradBuffer:
    """A GradBuffer of reproducible fp32 gradients (what a step's reduction hands the optimizer)."""
    buffer = GradBuffer(model)
    gen = torch.Generator().manual_seed(seed)
    for name in buffer.grads:
        buffer.grads[name] = torch.randn(buffer.grads[name].shape, generator=gen) * scale
    return buffer


def reference_adamw(model, cfg: GRPOConfig) -> torch.optim.AdamW:
    """torch's AdamW with transformers' grouping: matrices decay, norms and biases do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
    )


def max_param_diff(a, b) -> float:
    return max(
        float((p.detach() - q.detach()).abs().max())
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


@pytest.fixture(scope="module")
def llama(load_tiny):
    return load_tiny("llama")


def test_apply_matches_torch_adamw_on_the_same_grads(llama):
    cfg = GRPOConfig(learning_rate=1e-3, weight_decay=0.1, max_grad_norm=0.0)  # 0: no clipping
    model, reference = copy.deepcopy(llama), copy.deepcopy(llama)
    optimizer = PolicyOptimizer(model, cfg, num_steps=3)
    adamw = reference_adamw(reference, cfg)
    for step in range(3):
        grads = random_grads(model, seed=SEED + step)
        stats = optimizer.apply(grads)
        for name, p in reference.named_parameters():
            p.grad = grads.grads[name].clone()
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        assert not stats.clipped and stats.learning_rate == cfg.learning_rate
        # Same optimizer on the same fp32 tensors: bitwise.
        assert max_param_diff(model, reference) == 0.0, step
    assert max_param_diff(model, llama) > 0.0
    assert all(p.grad is None for p in model.parameters())


def test_clipping_scales_grads_to_max_grad_norm(llama):
    cfg = GRPOConfig(learning_rate=1e-3, max_grad_norm=0.5)
    model = copy.deepcopy(llama)
    optimizer = PolicyOptimizer(model, cfg, num_steps=1)
    grads = random_grads(model, seed=SEED, scale=1.0)
    norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.grads.values()])))
    stats = optimizer.apply(grads)
    assert stats.clipped
    assert stats.grad_norm == pytest.approx(norm, rel=1e-5)
    # After one step AdamW's first moment is (1 - beta1) * the gradient it was given.
    state = optimizer.state_tensors()
    given = {name: state[f"exp_avg/{name}"] / (1 - cfg.adam_beta1) for name in optimizer.names}
    given_norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in given.values()])))
    assert given_norm == pytest.approx(cfg.max_grad_norm, rel=1e-5), given_norm
    name = optimizer.names[0]
    expected = grads.grads[name] * (cfg.max_grad_norm / (norm + 1e-6))
    torch.testing.assert_close(given[name], expected, rtol=1e-5, atol=1e-9)


def test_grads_below_max_grad_norm_are_not_clipped(llama):
    cfg = GRPOConfig(learning_rate=1e-3, max_grad_norm=1e6)
    optimizer = PolicyOptimizer(copy.deepcopy(llama), cfg, num_steps=1)
    grads = random_grads(optimizer.model, seed=SEED)
    stats = optimizer.apply(grads)
    assert not stats.clipped
    name = optimizer.names[0]
    first_moment = optimizer.state_tensors()[f"exp_avg/{name}"]
    assert torch.equal(first_moment, grads.grads[name] * (1 - cfg.adam_beta1))


@pytest.mark.parametrize(
    ("warmup_steps", "num_steps", "expected"),
    [
        (0, 10, [1.0, 1.0, 1.0]),
        (4, 10, [0.25, 0.5, 0.75, 1.0, 1.0]),
        (0.25, 10, [1 / 3, 2 / 3, 1.0, 1.0]),  # ceil(0.25 * 10) = 3 warm-up steps
        (1, 10, [1.0, 1.0]),
    ],
)
def test_warmup_factor(warmup_steps, num_steps, expected):
    got = [warmup_factor(step, warmup_steps, num_steps) for step in range(len(expected))]
    assert got == pytest.approx(expected)


def test_apply_uses_the_warmed_up_learning_rate(llama):
    cfg = GRPOConfig(learning_rate=1e-3, warmup_steps=4)
    optimizer = PolicyOptimizer(copy.deepcopy(llama), cfg, num_steps=8)
    rates = [optimizer.apply(random_grads(optimizer.model, seed=s)).learning_rate for s in range(5)]
    assert rates == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert optimizer.step_count == 5


def test_bf16_model_keeps_fp32_masters(load_tiny):
    """A step far below a bf16 ulp moves the fp32 master but not necessarily the bf16 weight,
    which is always the master rounded to bf16."""
    model = load_tiny("llama", dtype=torch.bfloat16)
    cfg = GRPOConfig(learning_rate=1e-5, max_grad_norm=0.0)
    optimizer = PolicyOptimizer(model, cfg, num_steps=3)
    initial = [m.detach().clone() for m in optimizer.masters]
    assert all(m.dtype == torch.float32 for m in optimizer.masters)
    assert all(m is not p for m, p in zip(optimizer.masters, optimizer.params, strict=True))
    for step in range(3):
        optimizer.apply(random_grads(model, seed=SEED + step))
        for name, master, param, start in zip(
            optimizer.names, optimizer.masters, optimizer.params, initial, strict=True
        ):
            assert param.dtype == torch.bfloat16
            assert torch.equal(param, master.to(torch.bfloat16)), name
            moved = (master - start).abs()
            # Adam moves each weight by at most ~lr per step.
            assert float(moved.max()) <= (step + 1) * cfg.learning_rate * 1.01, name
            # bf16 spacing at |w| is 2^(floor(log2|w|) - 7); the step is below it for most weights.
            ulp = torch.exp2(torch.floor(torch.log2(start.abs().clamp_min(1e-30))) - 7)
            assert float((moved < ulp).float().mean()) > 0.5, name
    moved_masters = sum(
        int(not torch.equal(m, s)) for m, s in zip(optimizer.masters, initial, strict=True)
    )
    assert moved_masters == len(initial)
    # Most bf16 weights did not change at all: without masters the updates would be lost.
    unchanged = [
        torch.equal(p, s.to(torch.bfloat16)) for p, s in zip(optimizer.params, initial, strict=True)
    ]
    assert sum(unchanged) >= 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_grad_norm_raises_and_leaves_weights(llama, bad):
    model = copy.deepcopy(llama)
    optimizer = PolicyOptimizer(model, GRPOConfig(learning_rate=1e-3), num_steps=1)
    grads = random_grads(model, seed=SEED)
    grads.grads[optimizer.names[3]][0] = bad
    with pytest.raises(FloatingPointError, match="gradient norm is"):
        optimizer.apply(grads)
    assert max_param_diff(model, llama) == 0.0
    assert optimizer.step_count == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_round_trips_through_safetensors(load_tiny, tmp_path, dtype):
    cfg = GRPOConfig(learning_rate=1e-3, weight_decay=0.01, warmup_steps=3)
    model = load_tiny("llama", dtype=dtype)
    optimizer = PolicyOptimizer(model, cfg, num_steps=6)
    for step in range(2):
        optimizer.apply(random_grads(model, seed=SEED + step))
    save_file(optimizer.state_tensors(), str(tmp_path / "optimizer.safetensors"))
    resumed_model = copy.deepcopy(model)
    resumed = PolicyOptimizer(resumed_model, cfg, num_steps=6)
    resumed.load_state_tensors(load_file(str(tmp_path / "optimizer.safetensors")))
    assert resumed.step_count == 2
    a = optimizer.apply(random_grads(model, seed=SEED + 2))
    b = resumed.apply(random_grads(resumed_model, seed=SEED + 2))
    assert a == b
    assert max_param_diff(model, resumed_model) == 0.0
    for m, n in zip(optimizer.masters, resumed.masters, strict=True):
        assert torch.equal(m, n)
