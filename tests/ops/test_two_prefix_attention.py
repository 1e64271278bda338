"""prefix_cached_attention with a second prefix (`extra_prefix`: a long branch's earlier
segments on top of the prompt) against the materialising reference over [prefix1 ; prefix2 ;
branch]: outputs and every gradient, including each prefix's own buffer."""

import pytest
import torch

from longstraw.ops.attention_reference import naive_prefix_attention
from longstraw.ops.prefix_attention import prefix_cached_attention

SEED = 42
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


@pytest.mark.parametrize("chunk_size", [7, 64])
@pytest.mark.parametrize(("first", "second"), [(63, 17), (0, 9), (40, 0), (1, 1)])
@pytest.mark.parametrize("value_dim", [8, 12])  # 8: the CPU flash kernel; 12: the chunked loop
def test_two_prefixes_match_one_concatenated_prefix(first, second, chunk_size, value_dim):
    gen = torch.Generator().manual_seed(SEED)
    batch, heads, kv_heads, branch, dim = 2, 4, 2, 5, 8
    q = _randn(gen, batch, heads, branch, dim)
    kb, vb = (
        _randn(gen, batch, kv_heads, branch, dim),
        _randn(gen, batch, kv_heads, branch, value_dim),
    )
    k1, v1 = _randn(gen, first, kv_heads, dim), _randn(gen, first, kv_heads, value_dim)
    k2, v2 = _randn(gen, second, kv_heads, dim), _randn(gen, second, kv_heads, value_dim)
    grad_out = _randn(gen, batch, heads, branch, value_dim)
    scale = dim**-0.5

    leaves = [t.clone().requires_grad_() for t in (q, kb, vb)]
    buffers = [torch.zeros(t.shape) for t in (k1, v1, k2, v2)]
    out = prefix_cached_attention(
        *leaves,
        k1,
        v1,
        scale=scale,
        chunk_size=chunk_size,
        prefix_grad_k_TKD=buffers[0],
        prefix_grad_v_TKD=buffers[1],
        extra_prefix=(k2, v2, buffers[2], buffers[3]),
    )
    out.backward(grad_out)

    ref_leaves = [t.clone().requires_grad_() for t in (q, kb, vb)]
    kp, vp = torch.cat([k1, k2]).requires_grad_(), torch.cat([v1, v2]).requires_grad_()
    ref = naive_prefix_attention(*ref_leaves, kp, vp, scale=scale)
    ref.backward(grad_out)

    pairs = [
        ("out", out.detach(), ref.detach()),
        *(
            (f"d{n}", a.grad, e.grad)
            for n, a, e in zip(["q", "kb", "vb"], leaves, ref_leaves, strict=True)
        ),
        ("dk prefix 1", buffers[0], kp.grad[:first]),
        ("dv prefix 1", buffers[1], vp.grad[:first]),
        ("dk prefix 2", buffers[2], kp.grad[first:]),
        ("dv prefix 2", buffers[3], vp.grad[first:]),
    ]
    for what, actual, expected in pairs:
        diff = (actual - expected).abs()
        assert bool((diff <= FP32_ATOL + FP32_RTOL * expected.abs()).all()), (
            f"{what}: max_diff={diff.max().item():.3e} mean_diff={diff.mean().item():.3e}"
        )


def test_a_second_prefix_of_the_wrong_head_count_is_refused():
    gen = torch.Generator().manual_seed(SEED)
    q, kb, vb = _randn(gen, 1, 4, 3, 8), _randn(gen, 1, 2, 3, 8), _randn(gen, 1, 2, 3, 8)
    k1, v1 = _randn(gen, 5, 2, 8), _randn(gen, 5, 2, 8)
    bad = (_randn(gen, 4, 1, 8), _randn(gen, 4, 1, 8), None, None)
    with pytest.raises(ValueError, match="kv head mismatch"):
        prefix_cached_attention(q, kb, vb, k1, v1, scale=0.35, extra_prefix=bad)
