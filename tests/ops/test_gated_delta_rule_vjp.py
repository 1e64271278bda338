"""The hand-written float64 vector-Jacobian product of the chunked gated delta rule against
autograd through `chunked_in_float64` (the computation it differentiates), every input's
gradient including the initial state's."""

from __future__ import annotations

import pytest
import torch

from longstraw.ops.decay_gate import log_decays
from longstraw.ops.gated_delta_rule import chunked_in_float64
from longstraw.ops.gated_delta_rule_vjp import chunked_end_state_in_float64, chunked_vjp_in_float64

SEED = 42
# Both are float64 computations of the same chunked form in a different order: measured
# relative errors 0 to 1.3e-15 per gradient.
REL_TOL = 1e-12


def _inputs(batch, tokens, key_heads, value_heads, key_dim, value_dim):
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(batch, tokens, key_heads, key_dim, generator=gen)
    k = torch.randn(batch, tokens, key_heads, key_dim, generator=gen)
    v = torch.randn(batch, tokens, value_heads, value_dim, generator=gen)
    beta = torch.rand(batch, tokens, value_heads, generator=gen)
    a = torch.randn(batch, tokens, value_heads, generator=gen, dtype=torch.float64)
    A_log = torch.empty(value_heads, dtype=torch.float64).uniform_(-3, 1, generator=gen)
    g = log_decays(a, A_log, torch.zeros(value_heads, dtype=torch.float64))
    state = torch.randn(batch, value_heads, key_dim, value_dim, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize(
    ("shape", "chunk_size", "l2norm"),
    [
        ((1, 256, 4, 8, 64, 64), 64, True),
        ((2, 77, 2, 4, 16, 24), 16, True),
        ((1, 5, 1, 1, 8, 8), 64, False),
        ((1, 100, 2, 2, 16, 16), 32, False),
        ((1, 63, 1, 3, 8, 8), 8, True),
    ],
)
@pytest.mark.parametrize("cotangents", ["both", "output only", "final state only"])
def test_chunked_vjp_matches_autograd_in_float64(shape, chunk_size, l2norm, cotangents):
    q, k, v, g, beta, state = _inputs(*shape)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v, g, beta, state)]
    out, final = chunked_in_float64(
        *leaves[:5], initial_state=leaves[5], chunk_size=chunk_size, use_qk_l2norm_in_kernel=l2norm
    )
    gen = torch.Generator().manual_seed(SEED + 1)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grad_final = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    if cotangents == "output only":
        grad_final = None
    if cotangents == "final state only":
        grad_out = None
    used = [(t, gr) for t, gr in ((out, grad_out), (final, grad_final)) if gr is not None]
    want = torch.autograd.grad(
        [t for t, _ in used], leaves, [gr for _, gr in used], allow_unused=True
    )
    # Without an output cotangent the queries get none: zero.
    want = [torch.zeros_like(x) if w is None else w for x, w in zip(leaves, want, strict=True)]
    got = chunked_vjp_in_float64(
        q, k, v, g, beta, state, grad_out, grad_final,
        chunk_size=chunk_size, use_qk_l2norm_in_kernel=l2norm,
    )  # fmt: skip
    names = ["query", "key", "value", "g", "beta", "initial_state"]
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == torch.float64 and a.shape == b.shape, name
        diff = (a - b).abs()
        rel = 0.0 if diff.max() == 0 else (diff.norm() / b.norm()).item()
        assert rel <= REL_TOL, (
            f"{name}: relative error {rel:.3e} (max_diff {diff.max().item():.3e}, "
            f"mean_diff {diff.mean().item():.3e})"
        )


@pytest.mark.parametrize(
    ("shape", "chunk_size"), [((1, 256, 4, 8, 64, 64), 64), ((2, 77, 2, 4, 16, 24), 16)]
)
def test_kept_pieces_give_the_same_state_and_gradients_bitwise(shape, chunk_size):
    """The replay's final state is `chunked_in_float64`'s, and the product given what the
    replay kept is the product that computes them itself, bit for bit."""
    q, k, v, g, beta, state = _inputs(*shape)
    _, want_final = chunked_in_float64(
        q, k, v, g, beta, initial_state=state, chunk_size=chunk_size, use_qk_l2norm_in_kernel=True
    )
    final, kept = chunked_end_state_in_float64(
        q, k, v, g, beta, state, chunk_size=chunk_size, use_qk_l2norm_in_kernel=True
    )
    assert torch.equal(final, want_final)
    gen = torch.Generator().manual_seed(SEED + 2)
    grad_out = torch.randn(v.shape, generator=gen, dtype=torch.float64)
    grad_final = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    args = (q, k, v, g, beta, state, grad_out, grad_final)
    options = {"chunk_size": chunk_size, "use_qk_l2norm_in_kernel": True}
    computed = chunked_vjp_in_float64(*args, **options)
    given = chunked_vjp_in_float64(*args, **options, kept=kept)
    for a, b in zip(given, computed, strict=True):
        assert torch.equal(a, b)
