"""Absorbed multi-head latent attention (MLA) over [frozen prefix ; causal branch], with DSA selection.

Shape legend:
    B batch rows (samples of one prompt), H query heads, S queries of this forward (the last S
    branch positions), X branch keys (X >= S; X > S only when decoding keeps a branch overlay),
    T prefix positions (may be 0), R latent rank (`kv_lora_rank`), E rope dim (`qk_rope_head_dim`),
    N no-rope query/key head dim (`qk_nope_head_dim`), V value head dim, K selected positions per
    query (`index_topk`), C keys of one prefix chunk.

GLM-5 / DeepSeek MLA keeps per token only a latent c (after `kv_a_layernorm`, [R]) and one shared
rope key ([E]); per-head keys and values are `kv_b_proj(c)` = [W_uk c ; W_uv c]. Absorbing W_uk
into the query (q_lat = q_nope W_uk, [H, R]) makes the score q_nope.k_nope + q_rot.k_rot =
q_lat.c + q_rot.k_rot: one shared "key" (c, k_rot) for every head, and the output W_uv (sum p c):
attention runs on the latent itself, nothing per-head is ever materialised for the prefix.

Selection (DSA): `selected_BSK` holds, per query, the positions (in [0, T + X), prefix first) the
indexer kept; None means every causally visible position (the dense regime). Indices instead of a
[S, T] mask keep what backward holds independent of the prompt length.

The prefix partial is a custom autograd Function: prefix tensors are read chunk by chunk, never
copied or saved for backward (they are ctx attributes; the state lives anyway), and backward adds
d(latent) and d(rope key) of the prefix into caller-owned fp32 buffers (exact mode). The branch
partial is plain autograd over branch-sized tensors; both merge by log-sum-exp.
"""

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from longstraw.ops.partial_attention import merge_partial_attention


def split_kv_b_weight(kv_b_weight: Tensor, num_heads: int, nope_dim: int) -> tuple[Tensor, Tensor]:
    """`kv_b_proj.weight` [H * (N + V), R] -> (W_uk [H, N, R], W_uv [H, V, R]) as views."""
    rank = kv_b_weight.shape[-1]
    w_HXR = kv_b_weight.view(num_heads, -1, rank)
    return w_HXR[:, :nope_dim], w_HXR[:, nope_dim:]


def _keep_chunk(
    selected_BSK: Tensor | None, start: int, end: int, batch: int, queries: int, device
) -> Tensor | None:
    """[B, 1, S, end - start] bool: which positions in [start, end) each query selected."""
    if selected_BSK is None:
        return None
    width = end - start
    inside_BSK = (selected_BSK >= start) & (selected_BSK < end)
    # Out-of-chunk indices go to a spare column that is dropped, so no scatter collides.
    local_BSK = torch.where(inside_BSK, selected_BSK - start, width)
    keep = torch.zeros(batch, queries, width + 1, dtype=torch.bool, device=device)
    return keep.scatter_(-1, local_BSK, True)[..., :width].unsqueeze(1)


def _prefix_scores(q_lat_BHSR, q_rot_BHSE, lat_CR, rope_CE, keep_B1SC, scale):
    scores_BHSC = (q_lat_BHSR @ lat_CR.transpose(0, 1)).add_(q_rot_BHSE @ rope_CE.transpose(0, 1))
    scores_BHSC.mul_(scale)
    if keep_B1SC is not None:
        scores_BHSC.masked_fill_(~keep_B1SC, float("-inf"))
    return scores_BHSC


class _PrefixLatentAttention(torch.autograd.Function):
    """(out [B,H,S,R], lse [B,H,S]) of queries over the selected prefix positions, fp32."""

    @staticmethod
    def forward(ctx, q_lat_BHSR, q_rot_BHSE, lat_TR, rope_TE, selected_BSK, scale, chunk, grads):
        batch, heads, queries, rank = q_lat_BHSR.shape
        run_max = q_lat_BHSR.new_full((batch, heads, queries), float("-inf"))
        run_sum = q_lat_BHSR.new_zeros((batch, heads, queries))
        acc_BHSR = q_lat_BHSR.new_zeros((batch, heads, queries, rank))
        for start in range(0, lat_TR.shape[0], chunk):
            end = min(start + chunk, lat_TR.shape[0])
            lat_CR = lat_TR[start:end].float()
            keep = _keep_chunk(selected_BSK, start, end, batch, queries, q_lat_BHSR.device)
            scores = _prefix_scores(
                q_lat_BHSR, q_rot_BHSE, lat_CR, rope_TE[start:end].float(), keep, scale
            )
            new_max = torch.maximum(run_max, scores.amax(dim=-1))
            # A row that has seen only masked keys keeps max -inf; shift by 0 there (exp -> 0).
            shift = torch.where(torch.isinf(new_max), 0.0, new_max)
            rescale = torch.exp(run_max - shift)
            probs = scores.sub_(shift[..., None]).exp_()
            run_sum = run_sum * rescale + probs.sum(dim=-1)
            acc_BHSR = acc_BHSR * rescale[..., None] + probs @ lat_CR
            run_max = new_max
        has_keys = run_sum > 0
        out_BHSR = acc_BHSR / torch.where(has_keys, run_sum, 1.0)[..., None]
        shift = torch.where(torch.isinf(run_max), 0.0, run_max)
        lse_BHS = torch.where(has_keys, shift + torch.log(run_sum), float("-inf"))
        ctx.save_for_backward(q_lat_BHSR, q_rot_BHSE, out_BHSR, lse_BHS)
        # Prefix views and the selection are ctx attributes, not saved tensors: the state outlives
        # the graph, and `selected_BSK` is [B, S, K] (independent of T).
        ctx.prefix = (lat_TR, rope_TE, selected_BSK)
        ctx.scale, ctx.chunk, ctx.grads = scale, chunk, grads
        return out_BHSR, lse_BHS

    @staticmethod
    @once_differentiable
    def backward(ctx, dout_BHSR, dlse_BHS):
        q_lat_BHSR, q_rot_BHSE, out_BHSR, lse_BHS = ctx.saved_tensors
        lat_TR, rope_TE, selected_BSK = ctx.prefix
        grad_lat_TR, grad_rope_TE = ctx.grads
        scale = ctx.scale
        batch, _, queries, _ = q_lat_BHSR.shape
        dout_BHSR = torch.zeros_like(out_BHSR) if dout_BHSR is None else dout_BHSR.float()
        dlse_BHS = torch.zeros_like(lse_BHS) if dlse_BHS is None else dlse_BHS.float()
        # d score = p * (dout . v - dout . out + dlse); rows without keys have p = 0.
        delta_BHS = (dout_BHSR * out_BHSR).sum(dim=-1) - dlse_BHS
        lse_safe = lse_BHS.masked_fill(torch.isinf(lse_BHS), float("inf"))
        dq_lat = torch.zeros_like(q_lat_BHSR)
        dq_rot = torch.zeros_like(q_rot_BHSE)
        for start in range(0, lat_TR.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, lat_TR.shape[0])
            lat_CR, rope_CE = lat_TR[start:end].float(), rope_TE[start:end].float()
            keep = _keep_chunk(selected_BSK, start, end, batch, queries, q_lat_BHSR.device)
            scores = _prefix_scores(q_lat_BHSR, q_rot_BHSE, lat_CR, rope_CE, keep, scale)
            probs = scores.sub_(lse_safe[..., None]).exp_()
            dscores = (dout_BHSR @ lat_CR.transpose(0, 1)).sub_(delta_BHS[..., None]).mul_(probs)
            dscores.mul_(scale)
            dq_lat += dscores @ lat_CR
            dq_rot += dscores @ rope_CE
            if grad_lat_TR is not None:
                # The latent is both key (through q_lat) and value (through p).
                dlat_CR = torch.einsum("bhsc,bhsr->cr", dscores, q_lat_BHSR)
                dlat_CR += torch.einsum("bhsc,bhsr->cr", probs, dout_BHSR)
                grad_lat_TR[start:end] += dlat_CR
            if grad_rope_TE is not None:
                grad_rope_TE[start:end] += torch.einsum("bhsc,bhse->ce", dscores, q_rot_BHSE)
        return dq_lat, dq_rot, None, None, None, None, None, None


def _branch_partial(q_lat_BHSR, q_rot_BHSE, lat_BXR, rope_BXE, keep_B1SX, scale):
    """Plain-autograd attention over branch keys (causal + selection); (out, lse) fp32."""
    scores = q_lat_BHSR @ lat_BXR.unsqueeze(1).transpose(-1, -2)
    scores = (scores + q_rot_BHSE @ rope_BXE.unsqueeze(1).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep_B1SX, float("-inf"))
    row_max = scores.amax(dim=-1).detach()
    shift = torch.where(torch.isinf(row_max), 0.0, row_max)
    probs = torch.exp(scores - shift[..., None])
    total = probs.sum(dim=-1)
    has_keys = total > 0
    safe_total = torch.where(has_keys, total, torch.ones_like(total))
    out = (probs @ lat_BXR.unsqueeze(1)) / safe_total[..., None]
    lse = torch.where(has_keys, shift + torch.log(safe_total), float("-inf"))
    return out, lse


def latent_attention(
    q_lat_BHSR: Tensor,
    q_rot_BHSE: Tensor,
    latent_BXR: Tensor,
    rope_BXE: Tensor,
    prefix_latent_TR: Tensor,
    prefix_rope_TE: Tensor,
    *,
    scale: float,
    selected_BSK: Tensor | None = None,
    chunk_size: int = 1024,
    prefix_grad_latent_TR: Tensor | None = None,
    prefix_grad_rope_TE: Tensor | None = None,
) -> Tensor:
    """[B, H, S, R] fp32 attention output in latent space (before W_uv), absorbed queries given.

    Query i (of S) sits at branch position X - S + i and sees branch keys 0 .. X - S + i and every
    prefix position, restricted to `selected_BSK` when given. With `prefix_grad_*`, backward adds
    the prefix cotangent into them (fp32, [T, R] / [T, E]).
    """
    num_prefix = prefix_latent_TR.shape[0]
    q_lat, q_rot = q_lat_BHSR.float(), q_rot_BHSE.float()
    out, lse = branch_latent_partial(
        q_lat, q_rot, latent_BXR, rope_BXE, num_prefix, scale=scale, selected_BSK=selected_BSK
    )
    if num_prefix == 0:
        return out
    grads = (prefix_grad_latent_TR, prefix_grad_rope_TE)
    out_p, lse_p = _PrefixLatentAttention.apply(
        q_lat, q_rot, prefix_latent_TR, prefix_rope_TE, selected_BSK, scale, chunk_size, grads
    )
    return merge_partial_attention(out_p, lse_p, out, lse)[0]


def branch_latent_partial(
    q_lat_BHSR: Tensor,
    q_rot_BHSE: Tensor,
    latent_BXR: Tensor,
    rope_BXE: Tensor,
    num_prefix: int,
    *,
    scale: float,
    selected_BSK: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(out [B, H, S, R], lse [B, H, S]) fp32 of the S queries over the branch's own X keys:
    query i sits at branch position X - S + i, sees keys 0 .. X - S + i, and — with
    `selected_BSK` (positions counted from the prompt start, `num_prefix` tokens before the
    branch) — only the selected ones."""
    batch, _, queries, _ = q_lat_BHSR.shape
    branch_len = latent_BXR.shape[1]
    device = q_lat_BHSR.device
    query_pos = torch.arange(branch_len - queries, branch_len, device=device)
    causal_SX = torch.arange(branch_len, device=device)[None, :] <= query_pos[:, None]
    keep_B1SX = causal_SX.expand(batch, 1, queries, branch_len)
    if selected_BSK is not None:
        keep_B1SX = keep_B1SX & _keep_chunk(
            selected_BSK, num_prefix, num_prefix + branch_len, batch, queries, device
        )
    return _branch_partial(
        q_lat_BHSR.float(),
        q_rot_BHSE.float(),
        latent_BXR.float(),
        rope_BXE.float(),
        keep_B1SX,
        scale,
    )


def absorbed_mla_attention(
    q_nope_BHSN: Tensor,
    q_rot_BHSE: Tensor,
    latent_BXR: Tensor,
    rope_BXE: Tensor,
    prefix_latent_TR: Tensor,
    prefix_rope_TE: Tensor,
    kv_b_weight: Tensor,
    *,
    scale: float,
    selected_BSK: Tensor | None = None,
    chunk_size: int = 1024,
    prefix_grad_latent_TR: Tensor | None = None,
    prefix_grad_rope_TE: Tensor | None = None,
) -> Tensor:
    """[B, H, S, V] MLA output (input dtype): absorb W_uk into q, attend on latents, apply W_uv."""
    heads, nope_dim = q_nope_BHSN.shape[1], q_nope_BHSN.shape[-1]
    w_uk_HNR, w_uv_HVR = split_kv_b_weight(kv_b_weight, heads, nope_dim)
    q_lat_BHSR = torch.einsum("bhsn,hnr->bhsr", q_nope_BHSN, w_uk_HNR)
    out_lat_BHSR = latent_attention(
        q_lat_BHSR,
        q_rot_BHSE,
        latent_BXR,
        rope_BXE,
        prefix_latent_TR,
        prefix_rope_TE,
        scale=scale,
        selected_BSK=selected_BSK,
        chunk_size=chunk_size,
        prefix_grad_latent_TR=prefix_grad_latent_TR,
        prefix_grad_rope_TE=prefix_grad_rope_TE,
    )
    out_BHSV = torch.einsum("bhsr,hvr->bhsv", out_lat_BHSR.to(q_nope_BHSN.dtype), w_uv_HVR)
    return out_BHSV


def naive_mla_attention(
    q_nope_BHSN: Tensor,
    q_rot_BHSE: Tensor,
    latent_BLR: Tensor,
    rope_BLE: Tensor,
    kv_b_weight: Tensor,
    *,
    scale: float,
    keep_BSL: Tensor | None = None,
) -> Tensor:
    """Reference: decompress every position into per-head K/V and run masked softmax attention.

    `latent_BLR`/`rope_BLE` are all L = T + X positions in order; queries are the last S. `keep`
    is the selection (causality is applied here as well). Materialises [B, H, S, L]: tests only.
    """
    batch, heads, queries, nope_dim = q_nope_BHSN.shape
    length = latent_BLR.shape[1]
    kv_BLHX = (latent_BLR @ kv_b_weight.transpose(0, 1)).view(batch, length, heads, -1)
    k_nope_BHLN = kv_BLHX[..., :nope_dim].transpose(1, 2)
    v_BHLV = kv_BLHX[..., nope_dim:].transpose(1, 2)
    k_rot_BHLE = rope_BLE.unsqueeze(1).expand(-1, heads, -1, -1)
    key_BHLD = torch.cat([k_nope_BHLN, k_rot_BHLE], dim=-1)
    query_BHSD = torch.cat([q_nope_BHSN, q_rot_BHSE], dim=-1)
    scores = (query_BHSD @ key_BHLD.transpose(-1, -2)) * scale
    query_pos = torch.arange(length - queries, length, device=scores.device)
    visible_SL = torch.arange(length, device=scores.device)[None, :] <= query_pos[:, None]
    visible = visible_SL.expand(batch, queries, length)
    if keep_BSL is not None:
        visible = visible & keep_BSL
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v_BHLV
