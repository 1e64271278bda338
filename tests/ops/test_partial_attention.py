"""The prompt attention with its prefix split over ranks (`prefix_cached_attention(ranks=...)`,
`decode_attention(ranks=...)`) against the same op over the whole prefix and the materialised
reference; the log-sum-exp merge of partials.

The other ranks are simulated in this process (`SimulatedRanks`): every rank's part of the
prefix, computed with the op's own `prefix_partial` and `prefix_backward` as a rank of a
sequence group computes it, so what is tested here is exactly the arithmetic of the ranks
(`tests/distributed/` runs it on real process groups).

Legend: B batch, H query heads, K kv heads, R query rows, T prefix keys, D head dim, V value dim.
"""

from __future__ import annotations

import pytest
import torch

from longstraw.ops import dispatch
from longstraw.ops.attention_reference import naive_prefix_attention
from longstraw.ops.decode_attention import _prefix_partial_folded, decode_attention
from longstraw.ops.partial_attention import merge_partials, naive_partial
from longstraw.ops.prefix_attention import (
    prefix_backward,
    prefix_cached_attention,
    prefix_partial,
)

SEED = 42
B, H, K, R = 2, 4, 2, 13
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
# Rank parts of a 57-key prefix, one rank holding none; chunks of 16 keys.
PARTS = [(0, 37), (37, 37), (37, 57)]
CHUNK = 16


def _close(name: str, got: torch.Tensor, want: torch.Tensor, rtol=FP32_RTOL, atol=FP32_ATOL):
    diff = (got.double() - want.double()).abs()
    assert torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol), (
        f"{name}: max_diff {diff.max().item():.3e}, mean_diff {diff.mean().item():.3e}"
    )


class _Collected:
    """The `PrefixRanks.reduce` of one simulated rank: keeps the tensors it is asked to sum."""

    def reduce(self, tensors):
        self.tensors = tensors


class SimulatedRanks:
    """Rank `rank` of a prefix split into `parts`, the other ranks computed here."""

    replicated = True

    def __init__(self, k_TKD, v_TKV, parts, rank, grads=None, chunk_size=CHUNK):
        self.k_TKD, self.v_TKV, self.parts, self.rank = k_TKD, v_TKV, parts, rank
        self.grads, self.chunk_size = grads, chunk_size

    def _others(self):
        return [(i, a, b) for i, (a, b) in enumerate(self.parts) if i != self.rank]

    def queries_ready(self, q_BHRD, scale):
        self.q_BHRD, self.scale = q_BHRD, scale

    def gather(self, out, lse):
        partials = {self.rank: (out, lse)}
        for i, a, b in self._others():
            partials[i] = prefix_partial(
                self.q_BHRD, self.k_TKD[a:b], self.v_TKV[a:b], scale=self.scale,
                chunk_size=self.chunk_size,
            )  # fmt: skip
        return [partials[i] for i in range(len(self.parts))]

    def cotangent_ready(self, grad_out, out, lse):
        self.cotangent = (grad_out, out, lse)

    def reduce(self, tensors):
        for _, a, b in self._others():
            share = _Collected()
            grad_k, grad_v = (None, None) if self.grads is None else (g[a:b] for g in self.grads)
            prefix_backward(
                *self.cotangent[:1], self.q_BHRD, *self.cotangent[1:], self.k_TKD[a:b],
                self.v_TKV[a:b], scale=self.scale, chunk_size=self.chunk_size, grad_k_TKD=grad_k,
                grad_v_TKV=grad_v, ranks=share,
            )  # fmt: skip
            for total, part in zip(tensors, share.tensors, strict=True):
                total.add_(part)


def _inputs(value_dim: int, dtype=torch.float32, prefix_len=57):
    gen = torch.Generator().manual_seed(SEED)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return (
        randn(B, H, R, 8),
        randn(B, K, R, 8),
        randn(B, K, R, value_dim),
        randn(prefix_len, K, 8),
        randn(prefix_len, K, value_dim),
        randn(B, H, R, value_dim),
    )


def _run(q, kb, vb, kp, vp, grad_out, *, ranks_of=None):
    """(out, dq, dkb, dvb, dkp, dvp) of the op; `ranks_of(grad_k, grad_v)` -> (this rank's
    slice of the prefix and its buffers, a `PrefixRanks`), else the whole prefix here."""
    leaves = [t.clone().requires_grad_() for t in (q, kb, vb)]
    grad_k, grad_v = torch.zeros(kp.shape), torch.zeros(vp.shape)
    own, ranks = (kp, vp, grad_k, grad_v), None
    if ranks_of is not None:
        own, ranks = ranks_of(grad_k, grad_v)
    out = prefix_cached_attention(
        *leaves, own[0], own[1], scale=8**-0.5, chunk_size=CHUNK, prefix_grad_k_TKD=own[2],
        prefix_grad_v_TKD=own[3], ranks=ranks,
    )  # fmt: skip
    out.backward(grad_out)
    return [out.detach(), *(t.grad for t in leaves), grad_k, grad_v]


NAMES = ("out", "dq", "dk branch", "dv branch", "dk prefix", "dv prefix")


@pytest.mark.parametrize("rank", range(len(PARTS)))
@pytest.mark.parametrize(
    ("value_dim", "dtype", "kernel"),
    [
        (8, torch.float32, dispatch.ATEN_CPU_FLASH),  # the fused forward and backward
        (6, torch.float32, dispatch.TORCH),  # V != D: LongStraw's loops
        (8, torch.float64, dispatch.TORCH),
    ],
)
def test_prefix_split_over_ranks_matches_the_whole_prefix(rank, value_dim, dtype, kernel):
    inputs = _inputs(value_dim, dtype)
    q, kb, vb, kp, vp, grad_out = inputs
    assert dispatch.attention_kernel(q.device, dtype, 8, value_dim) == kernel

    def ranks_of(grad_k, grad_v):
        a, b = PARTS[rank]
        simulated = SimulatedRanks(kp, vp, PARTS, rank, grads=(grad_k, grad_v))
        return (kp[a:b], vp[a:b], grad_k[a:b], grad_v[a:b]), simulated

    got = _run(*inputs, ranks_of=ranks_of)
    whole = _run(*inputs)
    leaves = [t.double().requires_grad_() for t in (q, kb, vb, kp, vp)]
    naive = naive_prefix_attention(*leaves, scale=8**-0.5)
    naive.backward(grad_out.double())
    want = [naive.detach(), *(t.grad for t in leaves)]
    for name, g, w, n in zip(NAMES, got, whole, want, strict=True):
        assert g.abs().max() > 0, name
        _close(f"{name} vs the whole prefix", g, w)
        _close(f"{name} vs naive", g, n)


def test_decode_step_over_rank_parts_matches_single_process_decode_attention():
    """Q = 2 new queries over an overlay of X = 9 branch keys (bottom-right aligned) and the
    prefix split into uneven rank parts."""
    from longstraw.ops.decode_attention import naive_decode_attention

    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(B, H, 2, 8, generator=gen)
    kb, vb = torch.randn(B, K, 9, 8, generator=gen), torch.randn(B, K, 9, 8, generator=gen)
    kp, vp = torch.randn(57, K, 8, generator=gen), torch.randn(57, K, 8, generator=gen)
    scale = 8**-0.5
    q_KMD = q.reshape(B, K, -1, 8).transpose(0, 1).reshape(K, -1, 8)

    class DecodeRanks:
        replicated = True

        def gather(self, out, lse):
            parts = [
                _prefix_partial_folded(q_KMD, kp[a:b], vp[a:b], scale, CHUNK) for a, b in PARTS
            ]
            parts[1] = (out, lse)
            return parts

    got = decode_attention(
        q, kb, vb, kp[37:37], vp[37:37], scale=scale, chunk_size=CHUNK, ranks=DecodeRanks()
    )
    whole = decode_attention(q, kb, vb, kp, vp, scale=scale, chunk_size=CHUNK)
    _close("decode vs the whole prefix", got, whole)
    _close("decode vs naive", got, naive_decode_attention(q, kb, vb, kp, vp, scale=scale))


def test_merged_partials_of_key_sets_match_one_softmax_over_all_keys():
    # Three key sets of unequal size (one empty) plus a causal one.
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(B, H, R, 8, generator=gen) * 8**-0.5
    sets = [(torch.randn(B, K, t, 8, generator=gen), torch.randn(B, K, t, 6, generator=gen))
            for t in (37, 0, R)]  # fmt: skip
    visible = [torch.ones(R, 37, dtype=torch.bool), torch.ones(R, 0, dtype=torch.bool),
               torch.ones(R, R, dtype=torch.bool).tril()]  # fmt: skip
    partials = [naive_partial(q, k, v, m) for (k, v), m in zip(sets, visible, strict=True)]
    out, lse = merge_partials([o for o, _ in partials], [lse for _, lse in partials])
    k_all = torch.cat([k for k, _ in sets], dim=2)
    v_all = torch.cat([v for _, v in sets], dim=2)
    want_out, want_lse = naive_partial(q, k_all, v_all, torch.cat(visible, dim=1))
    _close("out", out, want_out)
    _close("lse", lse, want_lse)


def test_the_fused_and_the_loop_prefix_partial_agree():
    # V = D: the CPU flash kernel computes the partial; without it, LongStraw's loop.
    q, _, _, kp, vp, _ = _inputs(8)
    fused = prefix_partial(q, kp, vp, scale=0.3, chunk_size=CHUNK)
    loop = prefix_partial(q.double(), kp.double(), vp.double(), scale=0.3, chunk_size=CHUNK)
    _close("out", fused[0], loop[0])
    _close("lse", fused[1], loop[1])
    empty = prefix_partial(q, kp[:0], vp[:0], scale=0.3, chunk_size=CHUNK)
    assert not empty[0].any() and bool((empty[1] == float("-inf")).all())
