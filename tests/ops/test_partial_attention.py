"""The partial-attention pieces of the cross-rank attention against materialised references.

Legend: B batch, H query heads, K kv heads, R query rows, T prefix keys, D head dim, V value dim.
"""

from __future__ import annotations

import torch

from longstraw.ops.partial_attention import (
    causal_partial,
    causal_partial_backward,
    merge_partials,
    naive_partial,
    prefix_partial,
    prefix_partial_backward,
)

SEED = 42
B, H, K, R, D, V = 2, 4, 2, 13, 8, 6
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got - want).abs()
    assert torch.allclose(got, want, rtol=FP32_RTOL, atol=FP32_ATOL), (
        f"{name}: max_diff {diff.max().item():.3e}, mean_diff {diff.mean().item():.3e}"
    )


def _inputs(prefix_lens: tuple[int, ...]):
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(B, H, R, D, generator=gen) * D**-0.5
    kb, vb = torch.randn(B, K, R, D, generator=gen), torch.randn(B, K, R, V, generator=gen)
    prefixes = [
        (torch.randn(t, K, D, generator=gen), torch.randn(t, K, V, generator=gen))
        for t in prefix_lens
    ]
    return q, kb, vb, prefixes


def _naive_full(q, kb, vb, prefixes):
    """Materialised softmax over [all prefixes ; causal branch] as one key set."""
    k_all = torch.cat([*(k.permute(1, 0, 2).expand(B, -1, -1, -1) for k, _ in prefixes), kb], 2)
    v_all = torch.cat([*(v.permute(1, 0, 2).expand(B, -1, -1, -1) for _, v in prefixes), vb], 2)
    num_prefix = sum(k.shape[0] for k, _ in prefixes)
    visible = torch.ones(R, num_prefix + R, dtype=torch.bool)
    visible[:, num_prefix:] = torch.ones(R, R, dtype=torch.bool).tril()
    return naive_partial(q, k_all, v_all, visible)


def test_merged_rank_partials_match_naive_attention_over_all_keys():
    # Three "ranks" of unequal size (one empty) plus the causal branch, chunk smaller than T.
    q, kb, vb, prefixes = _inputs((37, 0, 20))
    outs, lses = [], []
    for k, v in prefixes:
        out, lse = prefix_partial(q, k, v, chunk_size=16)
        outs.append(out)
        lses.append(lse)
    out_b, lse_b = causal_partial(q, kb, vb)
    out, lse = merge_partials([*outs, out_b], [*lses, lse_b])
    want_out, want_lse = _naive_full(q, kb, vb, prefixes)
    _close("out", out, want_out)
    _close("lse", lse, want_lse)


def test_rank_local_backward_with_global_lse_matches_autograd():
    q, kb, vb, prefixes = _inputs((37, 0, 20))
    leaves = [t.clone().requires_grad_(True) for t in (q, kb, vb)]
    prefix_leaves = [
        (k.clone().requires_grad_(True), v.clone().requires_grad_(True)) for k, v in prefixes
    ]
    want_out, _ = _naive_full(*leaves, prefix_leaves)
    grad_out = torch.randn(want_out.shape, generator=torch.Generator().manual_seed(SEED + 1))
    want_out.backward(grad_out)

    outs, lses = zip(*(prefix_partial(q, k, v, chunk_size=16) for k, v in prefixes), strict=True)
    out_b, lse_b = causal_partial(q, kb, vb)
    out, lse = merge_partials([*outs, out_b], [*lses, lse_b])
    delta = (grad_out * out).sum(-1)
    grad_q = torch.zeros_like(q)
    for (k, v), (k_leaf, v_leaf) in zip(prefixes, prefix_leaves, strict=True):
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        grad_q += prefix_partial_backward(
            q, grad_out, lse, delta, k, v, chunk_size=16, grad_k_TKD=grad_k, grad_v_TKV=grad_v
        )
        if k.shape[0]:
            _close("prefix dK", grad_k, k_leaf.grad)
            _close("prefix dV", grad_v, v_leaf.grad)
    grad_q_b, grad_kb, grad_vb = causal_partial_backward(q, kb, vb, grad_out, lse, delta)
    _close("dq", grad_q + grad_q_b, leaves[0].grad)
    _close("branch dK", grad_kb, leaves[1].grad)
    _close("branch dV", grad_vb, leaves[2].grad)


def test_decode_step_merged_over_rank_partials_matches_single_process_decode_attention():
    """Q = 2 new queries over an overlay of X = 9 branch keys (bottom-right aligned) and a prefix
    split into uneven rank parts: the single-process `naive_decode_attention`."""
    from longstraw.ops.decode_attention import naive_decode_attention

    gen = torch.Generator().manual_seed(SEED)
    queries, overlay = 2, 9
    q = torch.randn(B, H, queries, D, generator=gen)
    kb, vb = (
        torch.randn(B, K, overlay, D, generator=gen),
        torch.randn(B, K, overlay, V, generator=gen),
    )
    k_prefix, v_prefix = torch.randn(57, K, D, generator=gen), torch.randn(57, K, V, generator=gen)
    scale = D**-0.5
    q_s = q * scale
    parts = [(0, 37), (37, 37), (37, 57)]  # one rank holds no positions
    partials = [prefix_partial(q_s, k_prefix[a:b], v_prefix[a:b], chunk_size=16) for a, b in parts]
    out_b, lse_b = causal_partial(q_s, kb, vb)
    out, _ = merge_partials(
        [*(o for o, _ in partials), out_b], [*(lse for _, lse in partials), lse_b]
    )
    want = naive_decode_attention(q, kb, vb, k_prefix, v_prefix, scale=scale)
    _close("decode out", out, want)


def test_fused_prefix_partial_matches_the_chunked_loop_and_the_naive_softmax():
    # V = D (as in every K/V family here): the CPU flash kernel computes the partial.
    from longstraw.ops.partial_attention import _chunked_partial, _flash_applies

    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(B, H, R, D, generator=gen) * D**-0.5
    k, v = torch.randn(45, K, D, generator=gen), torch.randn(45, K, D, generator=gen)
    assert _flash_applies(q, k, v)
    out, lse = prefix_partial(q, k, v, chunk_size=16)
    chunked_out, chunked_lse = _chunked_partial(q, k, v, 16)
    visible = torch.ones(R, 45, dtype=torch.bool)
    want_out, want_lse = naive_partial(q, k.permute(1, 0, 2).expand(B, -1, -1, -1),
                                       v.permute(1, 0, 2).expand(B, -1, -1, -1), visible)  # fmt: skip
    for name, got, want in [
        ("out vs naive", out, want_out),
        ("lse vs naive", lse, want_lse),
        ("out vs chunked", out, chunked_out),
        ("lse vs chunked", lse, chunked_lse),
    ]:
        _close(name, got, want)
    # Keys stored in bf16 with fp32 queries: the chunked loop (it upcasts one chunk at a time).
    k16, v16 = k.bfloat16(), v.bfloat16()
    assert not _flash_applies(q, k16, v16)
    out16, lse16 = prefix_partial(q, k16, v16, chunk_size=16)
    want16 = _chunked_partial(q, k16, v16, 16)
    assert torch.equal(out16, want16[0]) and torch.equal(lse16, want16[1])


def test_fused_causal_partial_matches_the_materialised_causal_softmax():
    # X = R and V = D: the CPU flash kernel (top-left causal mask) computes the branch part.
    from longstraw.ops import partial_attention

    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(B, H, R, D, generator=gen) * D**-0.5
    kb, vb = torch.randn(B, K, R, D, generator=gen), torch.randn(B, K, R, D, generator=gen)
    assert partial_attention._flash_applies(q, kb, vb)
    out, lse = causal_partial(q, kb, vb)
    visible = torch.ones(R, R, dtype=torch.bool).tril()
    want_out, want_lse = naive_partial(q, kb, vb, visible)
    _close("out", out, want_out)
    _close("lse", lse, want_lse)
