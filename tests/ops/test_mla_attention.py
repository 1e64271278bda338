"""Absorbed MLA over [prefix ; branch] against decompressed per-head attention (values and grads),
and over a prefix split into rank parts against the whole prefix."""

import pytest
import torch

from longstraw.ops.dsa_topk import stable_topk_mask
from longstraw.ops.mla_attention import (
    absorbed_mla_attention,
    latent_prefix_backward,
    latent_prefix_partial,
    naive_mla_attention,
)

SEED = 42
HEADS, NOPE, ROPE, VALUE, RANK = 3, 16, 8, 24, 12


def _inputs(batch, queries, branch, prefix, seed=SEED):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    return dict(
        q_nope=rand(batch, HEADS, queries, NOPE),
        q_rot=rand(batch, HEADS, queries, ROPE),
        latent=rand(batch, branch, RANK),
        rope=rand(batch, branch, ROPE),
        prefix_latent=rand(prefix, RANK),
        prefix_rope=rand(prefix, ROPE),
        kv_b=rand(HEADS * (NOPE + VALUE), RANK) * 0.3,
        scores=rand(batch, queries, prefix + branch).clamp(min=0.0),  # relu-like: many ties at 0
    )


def _selection(x, topk):
    """Stable top-k over causally visible positions, as indices (like the GLM adapter builds)."""
    batch, queries, length = x["scores"].shape
    query_pos = torch.arange(length - queries, length)
    visible = torch.arange(length)[None, :] <= query_pos[:, None]
    scores = x["scores"].masked_fill(~visible, float("-inf"))
    keep = stable_topk_mask(scores, topk)
    selected = keep.nonzero()[:, 2].view(batch, queries, -1)
    return keep, selected


def _report(fast, ref):
    diff = (fast - ref).abs()
    return f"max_diff {diff.max().item():.3e} mean_diff {diff.mean().item():.3e}"


@pytest.mark.parametrize(
    "batch,queries,branch,prefix,topk",
    [
        (1, 7, 7, 63, None),
        (2, 5, 5, 1000, 32),
        (1, 9, 9, 0, None),
        (1, 63, 63, 1000, 40),
        (1, 3, 8, 63, 16),
    ],
)
def test_absorbed_mla_matches_naive_decompressed_attention(batch, queries, branch, prefix, topk):
    x = _inputs(batch, queries, branch, prefix)
    keep, selected = (None, None) if topk is None else _selection(x, topk)
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q_nope", "q_rot", "latent", "rope")}
    prefix_lat = x["prefix_latent"].clone().requires_grad_(True)
    prefix_rope = x["prefix_rope"].clone().requires_grad_(True)
    all_lat = torch.cat([prefix_lat.expand(batch, -1, -1), leaves["latent"]], dim=1)
    all_rope = torch.cat([prefix_rope.expand(batch, -1, -1), leaves["rope"]], dim=1)
    ref = naive_mla_attention(
        leaves["q_nope"], leaves["q_rot"], all_lat, all_rope, x["kv_b"], scale=0.17, keep_BSL=keep
    )
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref_grads = torch.autograd.grad(
        (ref * cot).sum(), [*leaves.values(), prefix_lat, prefix_rope], allow_unused=True
    )

    fast_leaves = {n: x[n].clone().requires_grad_(True) for n in leaves}
    grad_lat = torch.zeros(prefix, RANK)
    grad_rope = torch.zeros(prefix, ROPE)
    fast = absorbed_mla_attention(
        fast_leaves["q_nope"],
        fast_leaves["q_rot"],
        fast_leaves["latent"],
        fast_leaves["rope"],
        x["prefix_latent"],
        x["prefix_rope"],
        x["kv_b"],
        scale=0.17,
        selected_BSK=selected,
        chunk_size=100,
        prefix_grad_latent_TR=grad_lat,
        prefix_grad_rope_TE=grad_rope,
    )
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6, msg=lambda m: _report(fast, ref))
    fast_grads = torch.autograd.grad((fast * cot).sum(), list(fast_leaves.values()))
    names = [*leaves, "prefix_latent", "prefix_rope"]
    for name, got, want in zip(names, [*fast_grads, grad_lat, grad_rope], ref_grads, strict=True):
        want = torch.zeros_like(got) if want is None else want
        torch.testing.assert_close(
            got,
            want,
            rtol=1e-5,
            atol=1e-5,
            msg=lambda m, g=got, w=want, n=name: f"{n}: {_report(g, w)}",
        )


def test_absorbed_mla_saves_nothing_prefix_sized():
    x = _inputs(1, 5, 5, 4000)
    _, selected = _selection(x, 32)
    q_nope = x["q_nope"].requires_grad_(True)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = absorbed_mla_attention(
            q_nope,
            x["q_rot"],
            x["latent"],
            x["rope"],
            x["prefix_latent"],
            x["prefix_rope"],
            x["kv_b"],
            scale=0.2,
            selected_BSK=selected,
        )
    out.sum().backward()
    # Largest branch-sized tensors: [H, N + V, R] weight views and [B, H, S, S] scores.
    assert max(sizes) < 4000, f"a saved tensor has {max(sizes)} elements (prefix has 4000 tokens)"


class _SimulatedLatentRanks:
    """Rank `rank` of a latent prefix split into `parts`, the other ranks computed here with the
    op's own `latent_prefix_partial` / `latent_prefix_backward`, as a rank of a sequence group
    computes its share (`tests/distributed/test_sharded_glm.py` runs real process groups)."""

    replicated = True

    def __init__(self, latent_TR, rope_TE, grads, parts, rank, chunk_size):
        self.latent_TR, self.rope_TE, self.grads = latent_TR, rope_TE, grads
        self.parts, self.rank, self.chunk_size = parts, rank, chunk_size
        self.num_prefix, self.local_start = latent_TR.shape[0], parts[rank][0]

    def _others(self):
        return [(i, a, b) for i, (a, b) in enumerate(self.parts) if i != self.rank]

    def _part(self, a, b, **kw):
        return dict(
            scale=0.17, selected_BSK=self.selected, local_start=a, chunk_size=self.chunk_size, **kw
        )

    def queries_ready(self, q_lat, q_rot, selected, needs_grad):
        self.q, self.selected = (q_lat, q_rot), selected

    def gather(self, out, lse):
        partials = {self.rank: (out, lse)}
        for i, a, b in self._others():
            partials[i] = latent_prefix_partial(
                *self.q, self.latent_TR[a:b], self.rope_TE[a:b], **self._part(a, b)
            )
        return [partials[i] for i in range(len(self.parts))]

    def cotangent_ready(self, grad_out, lse, delta):
        self.cotangent = (grad_out, lse, delta)

    def reduce(self, tensors):
        for _, a, b in self._others():
            grads = {"grad_latent_TR": self.grads[0][a:b], "grad_rope_TE": self.grads[1][a:b]}
            shares = latent_prefix_backward(
                *self.cotangent, *self.q, self.latent_TR[a:b], self.rope_TE[a:b],
                **self._part(a, b, **grads),
            )  # fmt: skip
            for total, share in zip(tensors, shares, strict=True):
                total.add_(share)


@pytest.mark.parametrize("topk", [None, 24])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_latent_prefix_split_over_ranks_matches_the_whole_prefix(rank, topk):
    """The prefix of 70 positions split 0-40 / 40-40 / 40-70 (one rank holds none), chunks of 16,
    against the op over the whole prefix: outputs and every gradient."""
    x = _inputs(2, 6, 6, 70)
    selected = None if topk is None else _selection(x, topk)[1]
    parts = [(0, 40), (40, 40), (40, 70)]

    def run(ranks_of):
        leaves = {
            n: x[n].clone().requires_grad_(True) for n in ("q_nope", "q_rot", "latent", "rope")
        }
        grads = (torch.zeros(70, RANK), torch.zeros(70, ROPE))
        lat, rope, grad_lat, grad_rope, ranks = ranks_of(grads)
        out = absorbed_mla_attention(
            *leaves.values(), lat, rope, x["kv_b"], scale=0.17, selected_BSK=selected,
            chunk_size=16, prefix_grad_latent_TR=grad_lat, prefix_grad_rope_TE=grad_rope,
            ranks=ranks,
        )  # fmt: skip
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        return [out.detach(), *(leaf.grad for leaf in leaves.values()), *grads]

    def split(grads):
        a, b = parts[rank]
        ranks = _SimulatedLatentRanks(
            x["prefix_latent"], x["prefix_rope"], grads, parts, rank, chunk_size=16
        )
        lat, rope = x["prefix_latent"][a:b], x["prefix_rope"][a:b]
        return lat, rope, grads[0][a:b], grads[1][a:b], ranks

    got = run(split)
    want = run(lambda grads: (x["prefix_latent"], x["prefix_rope"], *grads, None))
    names = ["out", "q_nope", "q_rot", "latent", "rope", "prefix_latent", "prefix_rope"]
    for name, g, w in zip(names, got, want, strict=True):
        assert w.abs().max() > 0, name
        torch.testing.assert_close(
            g, w, rtol=1e-5, atol=1e-6, msg=lambda m, g=g, w=w, n=name: f"{n}: {_report(g, w)}"
        )
