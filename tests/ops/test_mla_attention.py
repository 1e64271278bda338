"""Absorbed MLA over [prefix ; branch] against decompressed per-head attention (values and grads)."""

import pytest
import torch

from longstraw.ops.dsa_topk import stable_topk_mask
from longstraw.ops.mla_attention import absorbed_mla_attention, naive_mla_attention

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
