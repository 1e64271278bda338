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

One autograd Function computes it (`latent_attention`): the partial over the prefix and the
causal partial over the branch, merged by log-sum-exp, and a backward from the global output and
log-sum-exp (FlashAttention-2), chunk by chunk over the prefix as the forward reads it. Prefix
tensors are never copied or saved for backward (they are ctx attributes; the state lives
anyway), and backward adds d(latent) and d(rope key) of the prefix into caller-owned fp32
buffers (exact mode). On the ranks of a sequence group (`ranks`, a `LatentRanks`) each rank
holds a contiguous part of the prompt's positions: the partials over the parts are gathered and
merged in rank order, each rank adds its positions' cotangent and the dq shares are summed, as
for K/V attention (`longstraw.ops.prefix_attention`).
"""

from typing import Protocol

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from longstraw.ops.partial_attention import merge_partial_attention, merge_partials


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


def _prefix_latent_partial(q_lat_BHSR, q_rot_BHSE, lat_TR, rope_TE, selected_BSK, scale, chunk):
    """(out [B,H,S,R], lse [B,H,S]) fp32 of the queries over the selected prefix positions
    (`selected_BSK` in this prefix's own positions; None: all of them), chunk by chunk; a row
    that selected none of them has out 0 and lse -inf."""
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
    return out_BHSR, lse_BHS


def _local_selection(selected_BSK: Tensor | None, local_start: int) -> Tensor | None:
    # Positions outside [0, T_r) after the shift fall outside every chunk (`_keep_chunk` drops them).
    return selected_BSK if selected_BSK is None or local_start == 0 else selected_BSK - local_start


def latent_prefix_partial(
    q_lat_BHSR: Tensor,
    q_rot_BHSE: Tensor,
    prefix_latent_TR,
    prefix_rope_TE,
    *,
    scale: float,
    selected_BSK: Tensor | None = None,
    local_start: int = 0,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor]:
    """(out [B,H,S,R], lse [B,H,S]) fp32 of the absorbed queries (fp32) over the prefix positions
    [local_start, local_start + T) they selected (`selected_BSK`, positions counted from the
    prompt start; None: all): a rank's share of the latent attention over a prompt split over
    its sequence group, merged by log-sum-exp (`merge_partials`)."""
    return _prefix_latent_partial(
        q_lat_BHSR, q_rot_BHSE, prefix_latent_TR, prefix_rope_TE,
        _local_selection(selected_BSK, local_start), scale, chunk_size,
    )  # fmt: skip


def latent_prefix_backward(
    grad_out_BHSR: Tensor,
    lse_BHS: Tensor,
    delta_BHS: Tensor,
    q_lat_BHSR: Tensor,
    q_rot_BHSE: Tensor,
    prefix_latent_TR,
    prefix_rope_TE,
    *,
    scale: float,
    selected_BSK: Tensor | None = None,
    local_start: int = 0,
    chunk_size: int = 1024,
    grad_latent_TR: Tensor | None = None,
    grad_rope_TE: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The prefix positions' share of the latent attention's backward, from the GLOBAL output's
    cotangent, log-sum-exp and delta = rowsum(dO * out) (FlashAttention-2): returns this prefix's
    share of (dq_lat, dq_rot) and ADDS d(latent), d(rope key) of its positions into the fp32
    buffers when given, chunk by chunk as the forward reads them."""
    batch, _, queries, _ = q_lat_BHSR.shape
    selected_BSK = _local_selection(selected_BSK, local_start)
    # d score = p * (dout . v - delta); rows without keys have p = 0.
    lse_safe = lse_BHS.masked_fill(torch.isinf(lse_BHS), float("inf"))
    dq_lat = torch.zeros_like(q_lat_BHSR)
    dq_rot = torch.zeros_like(q_rot_BHSE)
    for start in range(0, prefix_latent_TR.shape[0], chunk_size):
        end = min(start + chunk_size, prefix_latent_TR.shape[0])
        lat_CR, rope_CE = prefix_latent_TR[start:end].float(), prefix_rope_TE[start:end].float()
        keep = _keep_chunk(selected_BSK, start, end, batch, queries, q_lat_BHSR.device)
        scores = _prefix_scores(q_lat_BHSR, q_rot_BHSE, lat_CR, rope_CE, keep, scale)
        probs = scores.sub_(lse_safe[..., None]).exp_()
        dscores = (grad_out_BHSR @ lat_CR.transpose(0, 1)).sub_(delta_BHS[..., None])
        dscores.mul_(probs).mul_(scale)
        dq_lat += dscores @ lat_CR
        dq_rot += dscores @ rope_CE
        if grad_latent_TR is not None:
            # The latent is both key (through q_lat) and value (through p).
            dlat_CR = torch.einsum("bhsc,bhsr->cr", dscores, q_lat_BHSR)
            dlat_CR += torch.einsum("bhsc,bhsr->cr", probs, grad_out_BHSR)
            grad_latent_TR[start:end] += dlat_CR
        if grad_rope_TE is not None:
            grad_rope_TE[start:end] += torch.einsum("bhsc,bhse->ce", dscores, q_rot_BHSE)
    return dq_lat, dq_rot


def _branch_keep(batch, queries, branch_len, num_prefix, selected_BSK, device) -> Tensor:
    """[B, 1, S, X] bool: query i (at branch position X - S + i) sees branch keys 0 .. X - S + i,
    restricted to the selected ones (`selected_BSK` counts from the prompt start)."""
    query_pos = torch.arange(branch_len - queries, branch_len, device=device)
    causal_SX = torch.arange(branch_len, device=device)[None, :] <= query_pos[:, None]
    keep_B1SX = causal_SX.expand(batch, 1, queries, branch_len)
    if selected_BSK is not None:
        keep_B1SX = keep_B1SX & _keep_chunk(
            selected_BSK, num_prefix, num_prefix + branch_len, batch, queries, device
        )
    return keep_B1SX


def _branch_scores(q_lat_BHSR, q_rot_BHSE, lat_BXR, rope_BXE, keep_B1SX, scale):
    scores = q_lat_BHSR @ lat_BXR.unsqueeze(1).transpose(-1, -2)
    scores = (scores + q_rot_BHSE @ rope_BXE.unsqueeze(1).transpose(-1, -2)) * scale
    return scores.masked_fill(~keep_B1SX, float("-inf"))


def _branch_partial(q_lat_BHSR, q_rot_BHSE, lat_BXR, rope_BXE, keep_B1SX, scale):
    """Attention over branch keys (causal + selection); (out, lse) fp32."""
    scores = _branch_scores(q_lat_BHSR, q_rot_BHSE, lat_BXR, rope_BXE, keep_B1SX, scale)
    row_max = scores.amax(dim=-1)
    shift = torch.where(torch.isinf(row_max), 0.0, row_max)
    probs = torch.exp(scores - shift[..., None])
    total = probs.sum(dim=-1)
    has_keys = total > 0
    safe_total = torch.where(has_keys, total, torch.ones_like(total))
    out = (probs @ lat_BXR.unsqueeze(1)) / safe_total[..., None]
    lse = torch.where(has_keys, shift + torch.log(safe_total), float("-inf"))
    return out, lse


class LatentRanks(Protocol):
    """The ranks that hold the rest of a latent prompt prefix (`longstraw.distributed`; None on
    one process), as `longstraw.ops.prefix_attention.PrefixRanks` for K/V: this process holds
    positions [local_start, local_start + T_r) of the `num_prefix` the queries see."""

    replicated: bool
    num_prefix: int
    local_start: int

    def queries_ready(
        self, q_lat_BHSR: Tensor, q_rot_BHSE: Tensor, selected_BSK, needs_grad: bool
    ) -> None:
        """The absorbed queries and their selection are known (before this rank's partial);
        `needs_grad`: a backward will follow."""

    def gather(self, out_BHSR: Tensor, lse_BHS: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Every rank's (out, lse) over its positions, this rank's among them, in rank order."""

    def cotangent_ready(self, grad_out_BHSR: Tensor, lse_BHS: Tensor, delta_BHS: Tensor) -> None:
        """The backward's inputs (global), before this rank's share is computed."""

    def reduce(self, tensors: list[Tensor]) -> None:
        """Sum `tensors` (the prompt's share of dq_lat, dq_rot) over the ranks, in place."""


class _LatentAttention(torch.autograd.Function):
    """out [B,H,S,R] fp32 of the absorbed queries over [prefix ; branch]: the partials over the
    prefix (merged over the ranks that hold it) and the branch merged by log-sum-exp; the
    backward from the global output and log-sum-exp, chunk by chunk over the prefix."""

    @staticmethod
    def forward(
        ctx, q_lat_BHSR, q_rot_BHSE, lat_BXR, rope_BXE, prefix, selected_BSK, scale, chunk, ranks
    ):
        lat_TR, rope_TE, _, _ = prefix
        batch, _, queries, _ = q_lat_BHSR.shape
        num_prefix = lat_TR.shape[0] if ranks is None else ranks.num_prefix
        keep_B1SX = _branch_keep(
            batch, queries, lat_BXR.shape[1], num_prefix, selected_BSK, q_lat_BHSR.device
        )
        out_BHSR, lse_BHS = _branch_partial(
            q_lat_BHSR, q_rot_BHSE, lat_BXR.float(), rope_BXE.float(), keep_B1SX, scale
        )
        if num_prefix > 0:
            local_start = 0 if ranks is None else ranks.local_start
            if ranks is not None:
                ranks.queries_ready(q_lat_BHSR, q_rot_BHSE, selected_BSK, any(ctx.needs_input_grad))
            partial = latent_prefix_partial(
                q_lat_BHSR, q_rot_BHSE, lat_TR, rope_TE, scale=scale, selected_BSK=selected_BSK,
                local_start=local_start, chunk_size=chunk,
            )  # fmt: skip
            if ranks is not None:
                outs, lses = zip(*ranks.gather(*partial), strict=True)
                partial = merge_partials(list(outs), list(lses))
            out_BHSR, lse_BHS = merge_partial_attention(*partial, out_BHSR, lse_BHS)
        ctx.save_for_backward(q_lat_BHSR, q_rot_BHSE, lat_BXR, rope_BXE, out_BHSR, lse_BHS)
        # Prefix views, their cotangent buffers and the selection are ctx attributes, not saved
        # tensors: the state outlives the graph, and `selected_BSK` is [B, S, K] (independent of T).
        ctx.prefix, ctx.selected, ctx.ranks = prefix, selected_BSK, ranks
        ctx.num_prefix, ctx.scale, ctx.chunk = num_prefix, scale, chunk
        return out_BHSR

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out_BHSR):
        q_lat, q_rot, lat_BXR, rope_BXE, out_BHSR, lse_BHS = ctx.saved_tensors
        lat_TR, rope_TE, grad_lat_TR, grad_rope_TE = ctx.prefix
        ranks, scale, selected = ctx.ranks, ctx.scale, ctx.selected
        grad_out = grad_out_BHSR.float()
        # FlashAttention-2: d score = p * (dout . v - delta) with the GLOBAL softmax (lse).
        delta_BHS = (grad_out * out_BHSR).sum(dim=-1)
        if ctx.num_prefix > 0:
            if ranks is not None:
                ranks.cotangent_ready(grad_out, lse_BHS, delta_BHS)
            dq_lat, dq_rot = latent_prefix_backward(
                grad_out, lse_BHS, delta_BHS, q_lat, q_rot, lat_TR, rope_TE, scale=scale,
                selected_BSK=selected, local_start=0 if ranks is None else ranks.local_start,
                chunk_size=ctx.chunk, grad_latent_TR=grad_lat_TR, grad_rope_TE=grad_rope_TE,
            )  # fmt: skip
            if ranks is not None:
                ranks.reduce([dq_lat, dq_rot])
        else:
            dq_lat, dq_rot = torch.zeros_like(q_lat), torch.zeros_like(q_rot)
        # The branch part: its keys are the branch's own latents and rope keys ([B, X, *]).
        batch, _, queries, _ = q_lat.shape
        lat_B1XR, rope_B1XE = lat_BXR.float().unsqueeze(1), rope_BXE.float().unsqueeze(1)
        keep_B1SX = _branch_keep(
            batch, queries, lat_BXR.shape[1], ctx.num_prefix, selected, q_lat.device
        )
        scores = _branch_scores(q_lat, q_rot, lat_BXR.float(), rope_BXE.float(), keep_B1SX, scale)
        lse_safe = lse_BHS.masked_fill(torch.isinf(lse_BHS), float("inf"))
        probs = scores.sub_(lse_safe[..., None]).exp_()
        dscores = (grad_out @ lat_B1XR.transpose(-1, -2)).sub_(delta_BHS[..., None])
        dscores.mul_(probs).mul_(scale)
        dq_lat += dscores @ lat_B1XR
        dq_rot += dscores @ rope_B1XE
        grad_lat_BXR = torch.einsum("bhsx,bhsr->bxr", dscores, q_lat)
        grad_lat_BXR += torch.einsum("bhsx,bhsr->bxr", probs, grad_out)
        grad_rope_BXE = torch.einsum("bhsx,bhse->bxe", dscores, q_rot)
        return (
            dq_lat,
            dq_rot,
            grad_lat_BXR.to(lat_BXR.dtype),
            grad_rope_BXE.to(rope_BXE.dtype),
            *[None] * 5,  # prefix, selection, scale, chunk, ranks
        )


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
    ranks: LatentRanks | None = None,
) -> Tensor:
    """[B, H, S, R] fp32 attention output in latent space (before W_uv), absorbed queries given.

    Query i (of S) sits at branch position X - S + i and sees branch keys 0 .. X - S + i and every
    prefix position, restricted to `selected_BSK` when given. With `prefix_grad_*`, backward adds
    the prefix cotangent into them (fp32, [T, R] / [T, E]). `ranks`: the prefix given is this
    rank's part of a prompt split over a sequence group (`LatentRanks`).
    """
    prefix = (prefix_latent_TR, prefix_rope_TE, prefix_grad_latent_TR, prefix_grad_rope_TE)
    return _LatentAttention.apply(
        q_lat_BHSR.float(), q_rot_BHSE.float(), latent_BXR, rope_BXE, prefix, selected_BSK,
        float(scale), chunk_size, ranks,
    )  # fmt: skip


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
    ranks: LatentRanks | None = None,
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
        ranks=ranks,
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
