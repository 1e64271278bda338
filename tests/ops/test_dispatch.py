"""Kernel dispatch (`longstraw.ops.dispatch`): which kernel each call site gets for which device,
dtype, shape and installed packages, every fallback, and the call sites' glue around the GPU
kernels — run on the CPU with the GPU packages faked by pure-torch stand-ins in `sys.modules`.

The stand-ins follow the packages' documented contracts (flash-attn's `flash_attn_func(...,
return_attn_probs=True)` -> (out [B, S, H, D], lse [B, H, S] fp32, padded here to 128 rows as some
releases do); fla's `chunk_gated_delta_rule`), so these tests check LongStraw's side of each call, not the kernels themselves.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from longstraw.ops import dispatch
from longstraw.ops.blockwise_backward import gated_delta_rule_recomputed_in_blocks
from longstraw.ops.decode_attention import decode_attention, naive_decode_attention
from longstraw.ops.gated_delta_rule import chunked_gated_delta_rule, naive_gated_delta_rule
from longstraw.ops.partial_attention import flash_prefix_partial, naive_partial
from longstraw.ops.prefix_attention import prefix_cached_attention

SEED = 42
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.installed.cache_clear()
    dispatch.reset_log()
    yield
    dispatch.installed.cache_clear()
    dispatch.reset_log()


@pytest.fixture
def fake_package(monkeypatch):
    """`fake_package(name, **functions)`: a module `name` that imports, holding `functions`."""

    def install(name: str, **functions):
        module = types.ModuleType(name)
        for attr, fn in functions.items():
            setattr(module, attr, fn)
        monkeypatch.setitem(sys.modules, name, module)
        dispatch.installed.cache_clear()
        return module

    return install


def fake_flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, return_attn_probs=False
):
    """flash-attn's contract in pure torch: [B, S, H, D] in, out in q's dtype, lse fp32
    [B, H, S rounded up to 128] (the padding is garbage that callers must drop)."""
    assert dropout_p == 0.0 and not causal and return_attn_probs
    heads = q.shape[2]
    k = k.float().repeat_interleave(heads // k.shape[2], dim=2)
    v = v.float().repeat_interleave(heads // v.shape[2], dim=2)
    scores = torch.einsum("bshd,bthd->bhst", q.float(), k) * softmax_scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhst,bthd->bshd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // 128) * 128), float("nan"))
    padded[..., : lse.shape[2]] = lse
    return out, padded, None


# --- choices -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "head_dim", "value_dim", "kv_dtypes", "want"),
    [
        (torch.float32, 16, 16, (), dispatch.ATEN_CPU_FLASH),
        (torch.bfloat16, 64, 64, (torch.bfloat16,), dispatch.ATEN_CPU_FLASH),
        (torch.float16, 16, 16, (), dispatch.TORCH),  # the CPU kernel has no fp16 here
        (torch.float64, 16, 16, (), dispatch.TORCH),  # gradcheck's dtype
        (torch.float32, 16, 24, (), dispatch.TORCH),  # V != D
        (torch.float32, 16, 16, (torch.bfloat16,), dispatch.TORCH),  # bf16 state, fp32 queries
    ],
)
def test_cpu_attention_takes_the_cpu_flash_kernel_where_it_applies(
    dtype, head_dim, value_dim, kv_dtypes, want, fake_package
):
    # flash-attn installed changes nothing on a CPU.
    fake_package("flash_attn", flash_attn_func=fake_flash_attn_func)
    assert dispatch.attention_kernel(CPU, dtype, head_dim, value_dim, kv_dtypes) == want


def test_cpu_attention_falls_back_when_torch_has_no_cpu_flash_kernel(monkeypatch):
    monkeypatch.setattr(dispatch, "CPU_FLASH", None)
    assert dispatch.attention_kernel(CPU, torch.float32, 16, 16) == dispatch.TORCH


@pytest.mark.parametrize(
    ("dtype", "head_dim", "value_dim", "kv_dtypes", "gpu", "want"),
    [
        (torch.bfloat16, 128, 128, (torch.bfloat16,), True, dispatch.FLASH_ATTN),
        (torch.float16, 256, 256, (), True, dispatch.FLASH_ATTN),
        (torch.float32, 128, 128, (), True, dispatch.TORCH),  # flash-attn has no fp32
        (torch.bfloat16, 320, 320, (), True, dispatch.TORCH),  # head dim > 256
        (torch.bfloat16, 12, 12, (), True, dispatch.TORCH),  # not a multiple of 8
        (torch.bfloat16, 128, 64, (), True, dispatch.TORCH),  # V != D
        (torch.bfloat16, 128, 128, (torch.float32,), True, dispatch.TORCH),  # fp32 state
        (torch.bfloat16, 128, 128, (), False, dispatch.TORCH),  # a site without a GPU kernel
    ],
)
def test_cuda_attention_takes_flash_attn_only_where_it_applies(
    dtype, head_dim, value_dim, kv_dtypes, gpu, want, fake_package
):
    fake_package("flash_attn", flash_attn_func=fake_flash_attn_func)
    got = dispatch.attention_kernel(CUDA, dtype, head_dim, value_dim, kv_dtypes, gpu=gpu)
    assert got == want


def test_cuda_attention_falls_back_without_flash_attn_or_with_a_broken_one(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises
    assert dispatch.installed("flash_attn") is None
    assert dispatch.attention_kernel(CUDA, torch.bfloat16, 128, 128) == dispatch.TORCH
    # Another device type (say "mps") never gets a GPU kernel.
    assert dispatch.attention_kernel(torch.device("meta"), torch.bfloat16, 128, 128) == "torch"


def test_fla_recompute_needs_cuda_half_precision_the_package_and_the_opt_in(
    fake_package, monkeypatch
):
    monkeypatch.delenv(dispatch.FLA_RECOMPUTE_ENV, raising=False)
    assert dispatch.delta_rule_recompute_kernel(CUDA, torch.bfloat16) == dispatch.TORCH
    monkeypatch.setenv(dispatch.FLA_RECOMPUTE_ENV, "1")
    assert dispatch.delta_rule_recompute_kernel(CUDA, torch.bfloat16) == dispatch.TORCH  # absent
    fake_package("fla", chunk_gated_delta_rule=naive_gated_delta_rule)
    assert dispatch.delta_rule_recompute_kernel(CUDA, torch.bfloat16) == dispatch.FLA
    assert dispatch.delta_rule_recompute_kernel(CUDA, torch.float16) == dispatch.FLA
    assert dispatch.delta_rule_recompute_kernel(CUDA, torch.float32) == dispatch.TORCH
    assert dispatch.delta_rule_recompute_kernel(CPU, torch.bfloat16) == dispatch.TORCH
    monkeypatch.setenv(dispatch.FLA_RECOMPUTE_ENV, "0")
    assert dispatch.delta_rule_recompute_kernel(CUDA, torch.bfloat16) == dispatch.TORCH


# --- the call sites' glue around a GPU kernel, faked on the CPU ---------------------------------


def _force(monkeypatch, attention=None, recompute=None):
    """Make the dispatch answer as it would on a GPU with the package installed."""
    if attention is not None:
        real = dispatch.attention_kernel

        def kernel(device, dtype, *args, gpu=True, **kwargs):
            if gpu and dtype in (torch.bfloat16, torch.float16):
                return attention
            return real(device, dtype, *args, gpu=gpu, **kwargs)

        monkeypatch.setattr(dispatch, "attention_kernel", kernel)
    if recompute is not None:
        monkeypatch.setattr(dispatch, "delta_rule_recompute_kernel", lambda *a: recompute)


def _prefix_inputs(batch=2, heads=4, kv_heads=2, rows=7, keys=70, dim=16, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(batch, heads, rows, dim, generator=gen).to(dtype)
    k = torch.randn(keys, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(keys, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v


def test_flash_attn_partial_folds_rows_and_drops_the_padded_lse(fake_package):
    fake_package("flash_attn", flash_attn_func=fake_flash_attn_func)
    q, k, v = _prefix_inputs(dtype=torch.float32)
    out, lse = dispatch.flash_attn_partial(q, k, v, 0.25)
    visible = torch.ones(q.shape[2], k.shape[0], dtype=torch.bool)
    k_b, v_b = (x.permute(1, 0, 2).expand(q.shape[0], -1, -1, -1) for x in (k, v))
    want_out, want_lse = naive_partial(q * 0.25, k_b, v_b, visible)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == want_out.shape
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)


def test_flash_prefix_partial_runs_flash_attn_per_chunk_and_logs_it(fake_package, monkeypatch):
    calls = []

    def spy(q, k, v, **kwargs):
        calls.append(k.shape[1])
        return fake_flash_attn_func(q, k, v, **kwargs)

    fake_package("flash_attn", flash_attn_func=spy)
    _force(monkeypatch, attention=dispatch.FLASH_ATTN)
    q, k, v = _prefix_inputs()
    out, lse = flash_prefix_partial(q, k, v, 0.25, 32, kernel=dispatch.FLASH_ATTN)
    assert calls == [32, 32, 6]  # chunks of the fixed grid, never the whole prefix
    assert dispatch.kernels_ran() == {"full_attention.prefix": dispatch.FLASH_ATTN}
    want_out, want_lse = flash_prefix_partial(
        q.float(), k.float(), v.float(), 0.25, 32, kernel=dispatch.ATEN_CPU_FLASH
    )
    # bf16 inputs, fp32 accumulation on both sides: STYLE.md's bf16 tolerance.
    torch.testing.assert_close(out, want_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, want_lse, rtol=2e-2, atol=2e-2)


def test_prefix_cached_attention_with_flash_attn_prefix_matches_the_torch_loop(
    fake_package, monkeypatch
):
    """The flash-attn forward (prefix partials by the kernel, branch by the loop, query chunks of
    3 rows) against the pure-torch forward; the backward is LongStraw's on both."""
    fake_package("flash_attn", flash_attn_func=fake_flash_attn_func)
    q, kp, vp = _prefix_inputs(rows=7, keys=70)
    gen = torch.Generator().manual_seed(SEED + 1)
    kb, vb = (torch.randn(2, 2, 7, 16, generator=gen).bfloat16() for _ in range(2))
    extra = (kp[:9].clone(), vp[:9].clone(), torch.zeros(9, 2, 16), torch.zeros(9, 2, 16))

    def run():
        leaves = [t.clone().requires_grad_(True) for t in (q, kb, vb)]
        grad_k, grad_v = torch.zeros(70, 2, 16), torch.zeros(70, 2, 16)
        extra_grads = (torch.zeros(9, 2, 16), torch.zeros(9, 2, 16))
        out = prefix_cached_attention(
            *leaves, kp, vp, scale=0.25, chunk_size=3,
            prefix_grad_k_TKD=grad_k, prefix_grad_v_TKD=grad_v,
            extra_prefix=(*extra[:2], *extra_grads),
        )  # fmt: skip
        out.float().square().sum().backward()
        return [out.detach(), *(t.grad for t in leaves), grad_k, grad_v, *extra_grads]

    # The torch loop: what runs on a GPU without flash-attn (the CPU kernel off).
    monkeypatch.setattr(dispatch, "CPU_FLASH", None)
    want = run()
    assert dispatch.kernels_ran()["full_attention.prefix"] == dispatch.TORCH
    dispatch.reset_log()
    _force(monkeypatch, attention=dispatch.FLASH_ATTN)
    got = run()
    assert dispatch.kernels_ran() == {
        "full_attention.prefix": dispatch.FLASH_ATTN,
        "full_attention.branch": dispatch.TORCH,
        # bf16 queries: LongStraw's backward loop (the fused CPU backward takes fp32 only).
        "full_attention.backward": dispatch.TORCH,
    }
    names = ["out", "dq", "dk branch", "dv branch", "dk prefix", "dv prefix", "dk 2nd", "dv 2nd"]
    for name, a, b in zip(names, got, want, strict=True):
        assert a.abs().max() > 0, name
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)


def test_decode_attention_with_flash_attn_matches_the_materialised_softmax(
    fake_package, monkeypatch
):
    fake_package("flash_attn", flash_attn_func=fake_flash_attn_func)
    _force(monkeypatch, attention=dispatch.FLASH_ATTN)
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(3, 4, 1, 16, generator=gen).bfloat16()
    kb, vb = (torch.randn(3, 2, 5, 16, generator=gen).bfloat16() for _ in range(2))
    kp, vp = (torch.randn(100, 2, 16, generator=gen).bfloat16() for _ in range(2))
    got = decode_attention(q, kb, vb, kp, vp, scale=0.25, chunk_size=40)
    assert dispatch.kernels_ran() == {"full_attention.decode": dispatch.FLASH_ATTN}
    want = naive_decode_attention(*(t.float() for t in (q, kb, vb, kp, vp)), scale=0.25)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def _delta_inputs(dtype=torch.bfloat16, T=70):
    gen = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(1, T, 2, 8, generator=gen).to(dtype) for _ in range(3))
    g = -torch.rand(1, T, 2, generator=gen)
    beta = torch.rand(1, T, 2, generator=gen)
    state = torch.randn(1, 2, 8, 8, generator=gen)
    return [q, k, v, g.to(dtype), beta.to(dtype), state]


def _blockwise_grads(inputs):
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out, final = gated_delta_rule_recomputed_in_blocks(
        chunked_gated_delta_rule, *leaves, output_final_state=True,
        use_qk_l2norm_in_kernel=True, block_tokens=32,
    )  # fmt: skip
    (out.float().square().sum() + final.square().sum()).backward()
    return [t.grad for t in leaves]


def test_blockwise_recompute_runs_fla_when_chosen_and_torch_otherwise(fake_package, monkeypatch):
    calls = []

    def fla_like(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False):  # fmt: skip
        calls.append(q.shape[1])
        return naive_gated_delta_rule(
            q, k, v, g, beta, initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )  # fmt: skip

    fake_package("fla", chunk_gated_delta_rule=fla_like)
    inputs = _delta_inputs()
    want = _blockwise_grads(inputs)
    assert dispatch.kernels_ran() == {"linear_attention.recompute": dispatch.TORCH}
    assert calls == []
    dispatch.reset_log()
    _force(monkeypatch, recompute=dispatch.FLA)
    got = _blockwise_grads(inputs)
    assert calls == [6, 32, 32]  # the blocks, last to first, each from its entering state
    assert dispatch.kernels_ran() == {"linear_attention.recompute": dispatch.FLA}
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], got, want, strict=True):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)


# --- the log -------------------------------------------------------------------------------------


def test_each_site_logs_its_kernel_once(caplog):
    with caplog.at_level(logging.INFO, logger="longstraw.kernels"):
        for _ in range(3):
            dispatch.ran("full_attention.prefix", dispatch.ATEN_CPU_FLASH)
        dispatch.ran("full_attention.prefix", dispatch.TORCH)
        dispatch.ran("linear_attention.recompute", dispatch.TORCH)
    lines = [r.getMessage() for r in caplog.records if r.name == "longstraw.kernels"]
    assert lines == [
        "kernel for full_attention.prefix: aten-cpu-flash",
        "kernel for full_attention.prefix: torch",
        "kernel for linear_attention.recompute: torch",
    ]
    assert dispatch.kernels_ran() == {
        "full_attention.prefix": "aten-cpu-flash, torch",
        "linear_attention.recompute": "torch",
    }
    dispatch.reset_log()
    assert dispatch.kernels_ran() == {}


def test_cpu_prefix_attention_records_what_ran_per_dtype():
    gen = torch.Generator().manual_seed(SEED)
    for dtype, want in ((torch.float32, dispatch.ATEN_CPU_FLASH), (torch.float64, dispatch.TORCH)):
        dispatch.reset_log()
        q = torch.randn(1, 2, 3, 8, generator=gen, dtype=dtype)
        kb = torch.randn(1, 1, 3, 8, generator=gen, dtype=dtype)
        kp = torch.randn(5, 1, 8, generator=gen, dtype=dtype)
        prefix_cached_attention(q, kb, kb, kp, kp, scale=0.3)
        assert dispatch.kernels_ran() == {
            "full_attention.prefix": want,
            "full_attention.branch": want,
        }
