"""Decode attention (new queries over [frozen prefix ; the rows' own keys]) against the
materialised reference, on both of its prefix paths, and the branch buffer decoding keeps.

Legend: B rows, H query heads, K kv heads, Q new queries, N branch keys, T prefix keys, D / V dims.
"""

from __future__ import annotations

import pytest
import torch

from longstraw.engine.cache import BranchBuffer
from longstraw.ops import decode_attention as da
from longstraw.ops import dispatch, partial_attention
from longstraw.ops.decode_attention import decode_attention, naive_decode_attention

FP32 = dict(rtol=1e-5, atol=1e-6)


def _inputs(b, h, k, q_len, n, t, d, v, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return rnd(b, h, q_len, d), rnd(b, k, n, d), rnd(b, k, n, v), rnd(t, k, d), rnd(t, k, v)


@pytest.mark.parametrize(
    ("b", "h", "k", "q_len", "n", "t", "d", "v"),
    [
        (8, 8, 2, 1, 1, 700, 16, 16),  # the first decoding step: one own key per row
        (8, 8, 2, 1, 9, 1300, 16, 16),  # later steps; T past the kernel's 512-key blocks
        (3, 4, 4, 1, 5, 64, 8, 8),  # no GQA
        (2, 6, 2, 3, 7, 33, 16, 16),  # several new queries, bottom-right causal
        (4, 4, 2, 1, 3, 0, 16, 16),  # empty prefix (a one-token prompt)
        (2, 4, 2, 2, 4, 40, 16, 24),  # V != D: the chunked fallback
    ],
)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "chunked"])
def test_decode_attention_matches_materialised_softmax(
    b, h, k, q_len, n, t, d, v, fused, monkeypatch
):
    if not fused:
        monkeypatch.setattr(da, "_prefix_kernel", lambda *args: dispatch.TORCH)
    q, kb, vb, kp, vp = _inputs(b, h, k, q_len, n, t, d, v)
    got = decode_attention(q, kb, vb, kp, vp, scale=d**-0.5)
    want = naive_decode_attention(q, kb, vb, kp, vp, scale=d**-0.5)
    torch.testing.assert_close(got, want, **FP32)


def test_decode_attention_reads_strided_branch_views_and_a_permuted_query():
    """The branch K/V are views of a longer buffer and q comes transposed, as in a model."""
    q, kb, vb, kp, vp = _inputs(4, 8, 2, 1, 6, 300, 16, 16)
    buffer_k = torch.zeros(4, 2, 32, 16)
    buffer_v = torch.zeros(4, 2, 32, 16)
    buffer_k[:, :, :6], buffer_v[:, :, :6] = kb, vb
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    got = decode_attention(q_strided, buffer_k[:, :, :6], buffer_v[:, :, :6], kp, vp, scale=0.25)
    torch.testing.assert_close(got, naive_decode_attention(q, kb, vb, kp, vp, scale=0.25), **FP32)


def test_decode_attention_bf16_is_close_to_fp32():
    q, kb, vb, kp, vp = _inputs(4, 8, 2, 1, 5, 600, 16, 16, dtype=torch.bfloat16)
    got = decode_attention(q, kb, vb, kp, vp, scale=0.25)
    want = naive_decode_attention(
        q.float(), kb.float(), vb.float(), kp.float(), vp.float(), scale=0.25
    )
    assert got.dtype == torch.bfloat16
    # STYLE.md: bf16 2e-2.
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_decode_attention_does_not_copy_the_prefix_per_row(monkeypatch):
    """Each fused call sees one prefix chunk once ([1, K, C, D], a view of the state's rows)
    with all rows folded into its queries."""
    seen = []
    flash = partial_attention._CPU_FLASH

    def spy(q, k, v, *args, **kwargs):
        seen.append((tuple(q.shape), tuple(k.shape), k.data_ptr()))
        return flash(q, k, v, *args, **kwargs)

    # The prefix chunks go through the one per-chunk flash partial (ops/partial_attention.py).
    monkeypatch.setattr(partial_attention, "_CPU_FLASH", spy)
    q, kb, vb, kp, vp = _inputs(8, 8, 2, 1, 4, 256, 16, 16)
    decode_attention(q, kb, vb, kp, vp, scale=0.25)
    assert seen == [((1, 2, 32, 16), (1, 2, 256, 16), kp.data_ptr())]
    seen.clear()
    got = decode_attention(q, kb, vb, kp, vp, scale=0.25, chunk_size=100)
    assert seen == [
        ((1, 2, 32, 16), (1, 2, rows, 16), kp[start].data_ptr())
        for start, rows in ((0, 100), (100, 100), (200, 56))
    ]
    torch.testing.assert_close(got, naive_decode_attention(q, kb, vb, kp, vp, scale=0.25), **FP32)


def test_branch_buffer_appends_in_place_and_grows_past_its_capacity():
    buffer = BranchBuffer(dim=2, capacity=3)
    parts = [torch.randn(2, 1, 1, 4) for _ in range(5)]
    views = [buffer.append(x) for x in parts]
    first_storage = views[0].untyped_storage().data_ptr()
    # Within capacity the same storage is written in place: no per-step allocation.
    assert views[2].untyped_storage().data_ptr() == first_storage
    assert views[3].untyped_storage().data_ptr() != first_storage  # doubled past 3 tokens
    for i, view in enumerate(views):
        assert torch.equal(view, torch.cat(parts[: i + 1], dim=2)), i
    assert buffer.length == 5


def test_branch_buffer_refuses_tensors_that_need_grad():
    buffer = BranchBuffer(dim=1)
    with pytest.raises(RuntimeError, match="no_grad"):
        buffer.append(torch.randn(2, 1, 3, requires_grad=True))
