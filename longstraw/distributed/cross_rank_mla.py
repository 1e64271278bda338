"""GLM-5 attention over a sequence-sharded latent prefix: absorbed MLA and a global DSA top-k.

Legend: B batch rows, H heads, S queries of this forward, X branch keys (X = S in replay and
prefill; X > S when decoding over the kept overlay, replicated and without autograd), T prefix positions visible to the queries (global), T_r of them held by this
rank, starting at global position `local_start`; R latent rank, E rope dim, Hi / Di indexer
heads / key dim, K `index_topk`, N ranks, C candidates of one query.

The single-process forward (`longstraw.models.glm.longstraw_mla_forward`) is kept step by step;
only the two places that read the prefix change:

* **DSA selection is a GLOBAL top-k.** Each rank scores the prefix positions it holds with the
  indexer (`longstraw.models.glm.index_scores`, the same ops, chunk by chunk) and keeps its local
  top-k (the single-process rule `stable_topk_indices`: ties to the earlier position) as
  (score, global position) pairs, padded to K with (-inf, +inf). One all_gather gives every
  participating rank N·K candidates; with the branch's own scores appended, the K best under the
  order (score descending, position ascending) are the single-process selection: the top-k of a
  union under a total order is the top-k of the union of each part's top-k. Positions travel as
  float64 (exact to 2^53). Per query, N·K candidates move — never a key.
* **Absorbed MLA over the prefix** is per-rank partials (out, lse) over each rank's own latents,
  restricted to the selected positions it holds (`_PrefixLatentAttention` of the single-process
  op on this rank's slice, the selection shifted to local indices), merged by log-sum-exp in rank
  order, then merged with the causal branch partial exactly as `latent_attention` does. Backward
  (FlashAttention-2 style, like `cross_rank_attention`): every rank receives the merged prefix's
  (dO, lse, delta = dO·out − dlse) and feeds its own partial the cotangents
  d out_r = w_r dO, d lse_r = w_r (dO·out_r − delta) with w_r = exp(lse_r − lse); the op's own
  backward then adds d(latent), d(rope key) of THIS rank's positions into this rank's fp32
  cotangent slice and returns its share of dq, and the dq shares are all-reduced. No latent moves.

Modes as in `cross_rank_attention`: replicated (branch replay, every rank runs the same branch,
no headers) and owner (prefill / sweep: the owner broadcasts a 7-int header before each exchange,
`serve_mla_owner` answers). Header layouts: select `[op, layer, B, S, Hi, Di, 0]`, forward
`[op, layer, B, H, S, K (0: dense), needs_grad]`, backward `[op, layer, B, H, S, 0, 0]`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable
from transformers import PreTrainedModel
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention

from longstraw.distributed.cross_rank_attention import (
    COMM,
    OP_DONE,
    OP_GRADIENT_SLICES,
    _all_reduce,
    _broadcast,
    _header,
    answer_gradient_slices,
)
from longstraw.engine.cache import PrefixMlaLayer, SegmentMlaLayer
from longstraw.models import glm
from longstraw.models.glm import index_scores, kv_b_weight, mla_inputs, previous_selection
from longstraw.models.patching import forwards_replaced
from longstraw.models.stable_routing import stable_routing_installed
from longstraw.ops.dsa_topk import stable_topk_indices
from longstraw.ops.mla_attention import (
    _PrefixLatentAttention,
    branch_latent_partial,
    split_kv_b_weight,
)
from longstraw.ops.partial_attention import merge_partial_attention, merge_partials

# Header ops of the MLA exchanges (after cross_rank_attention's 0 forward, 1 backward, 2 done).
OP_MLA_SELECT, OP_MLA_FORWARD, OP_MLA_BACKWARD = 3, 4, 5


class CrossRankMlaLayer(PrefixMlaLayer):
    """An MLA layer whose prefix on THIS rank is positions [local_start, local_start + T_r).

    `num_prefix` is the global T the queries see (the shard start in owner mode, the whole state
    in replay). `owner` None: replicated mode; otherwise the rank that runs the model.
    `keep_branch` (decoding, replicated only): keep the branch's latents between steps.
    """

    def __init__(
        self,
        prefix_latent_TR: Tensor,
        prefix_rope_TE: Tensor,
        prefix_index_TD: Tensor | None,
        *,
        group: dist.ProcessGroup | None,
        owner: int | None,
        num_prefix: int,
        local_start: int,
        grad_latent_TR: Tensor | None = None,
        grad_rope_TE: Tensor | None = None,
        on_update=None,
        keep_branch: bool = False,
    ):
        if keep_branch and owner is not None:
            raise ValueError("decoding (keep_branch) runs replicated: pass owner=None")
        super().__init__(
            prefix_latent_TR,
            prefix_rope_TE,
            prefix_index_TD,
            grad_latent_TR=grad_latent_TR,
            grad_rope_TE=grad_rope_TE,
            on_update=on_update,
            keep_branch=keep_branch,
        )
        self.group = group
        self.owner = owner
        self.num_prefix = num_prefix
        self.local_start = local_start

    def gather_candidates(
        self, layer_idx: int, indexer, q_BSHD: Tensor, weights_BSH: Tensor
    ) -> list[Tensor]:
        """Every rank's local top-k candidates for the queries, in rank order (owner mode: the
        header and the queries are broadcast first). `wavefront_prefill` overrides the exchange."""
        if self.owner is not None:
            batch, queries, heads, dim = q_BSHD.shape
            header = _header(OP_MLA_SELECT, (layer_idx, batch, queries, heads, dim, 0))
            _broadcast(header, self.owner, self.group)
            _broadcast(pack_index_queries(q_BSHD, weights_BSH), self.owner, self.group)
        return _gathered_candidates(
            indexer, q_BSHD, weights_BSH, self.prefix_index_TD, self.local_start,
            indexer.index_topk, self.group,
        )  # fmt: skip

    def prefix_attention(
        self,
        q_lat_BHSR: Tensor,
        q_rot_BHSE: Tensor,
        layer_idx: int,
        selected_BSK: Tensor | None,
        scale: float,
        needs_grad: bool,
    ) -> tuple[Tensor, Tensor]:
        """(out, lse) of the queries over the whole sharded visible prefix (fp32 queries)."""
        return _CrossRankLatentPrefix.apply(
            q_lat_BHSR, q_rot_BHSE, self, layer_idx, selected_BSK, scale, needs_grad
        )


class CrossRankSegmentMlaLayer(SegmentMlaLayer, CrossRankMlaLayer):
    """A long branch's segment over a sharded prompt (replicated): the prompt's latents are read
    across ranks as by `CrossRankMlaLayer`, and the branch's earlier segments — the same on
    every rank — are prepended to this forward's latents, rope and indexer keys (`earlier`, as
    `SegmentMlaLayer` does single-process), so every rank reads them as causal branch keys
    itself and their cotangent goes to its own copy of the branch's."""


def _all_gather(t: Tensor, group) -> list[Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    COMM.add(t)
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


# --- DSA selection -----------------------------------------------------------------------------


def local_topk_candidates(
    indexer, q_BSHD: Tensor, weights_BSH: Tensor, index_TD: Tensor, local_start: int, topk: int
) -> Tensor:
    """[B, S, K, 2] float64 (score, global position) of this rank's best K positions (stable
    rule), padded with (-inf, +inf) when it holds fewer than K."""
    batch, queries = q_BSHD.shape[:2]
    out = torch.empty(batch, queries, topk, 2, dtype=torch.float64, device=q_BSHD.device)
    out[..., 0], out[..., 1] = float("-inf"), float("inf")
    num = index_TD.shape[0]
    if num == 0:
        return out
    scores_BST = torch.cat(
        [
            index_scores(indexer, q_BSHD, weights_BSH, index_TD[s : s + glm.PREFIX_CHUNK_TOKENS])
            for s in range(0, num, glm.PREFIX_CHUNK_TOKENS)
        ],
        dim=-1,
    )
    if num > topk:
        index_BSK = stable_topk_indices(scores_BST, topk)
        scores_BSK = scores_BST.gather(-1, index_BSK)
    else:
        index_BSK = torch.arange(num, device=q_BSHD.device).expand(batch, queries, num)
        scores_BSK = scores_BST
    kept = index_BSK.shape[-1]
    out[..., :kept, 0] = scores_BSK.double()
    out[..., :kept, 1] = (index_BSK + local_start).double()
    return out


def global_topk(candidates_BSC2: Tensor, topk: int) -> Tensor:
    """[B, S, K] int64 ascending positions: the K best candidates by (score desc, position asc)."""
    by_position = candidates_BSC2[..., 1].argsort(dim=-1, stable=True)
    scores_BSC = candidates_BSC2[..., 0].gather(-1, by_position)
    positions_BSC = candidates_BSC2[..., 1].gather(-1, by_position)
    best_BSK = stable_topk_indices(scores_BSC, topk)
    return positions_BSC.gather(-1, best_BSK).sort(dim=-1).values.long()


def _gathered_candidates(indexer, q_BSHD, weights_BSH, layer_index_TD, local_start, topk, group):
    local = local_topk_candidates(indexer, q_BSHD, weights_BSH, layer_index_TD, local_start, topk)
    return _all_gather(local, group)


def pack_index_queries(q_BSHD: Tensor, weights_BSH: Tensor) -> Tensor:
    """[B, S, Hi, Di + 1] fp32: the indexer queries and weights as they travel to serving ranks."""
    return torch.cat([q_BSHD.float(), weights_BSH.float()[..., None]], dim=-1).contiguous()


def serve_candidates(indexer, packed_BSHD1: Tensor, index_TD: Tensor, local_start: int) -> Tensor:
    """A serving rank's local top-k candidates for packed indexer queries (`pack_index_queries`)."""
    dim = packed_BSHD1.shape[-1] - 1
    return local_topk_candidates(
        indexer, packed_BSHD1[..., :dim], packed_BSHD1[..., dim], index_TD, local_start,
        indexer.index_topk,
    )  # fmt: skip


@torch.no_grad()
def sharded_dsa_selection(
    layer: CrossRankMlaLayer,
    layer_idx: int,
    indexer,
    q_BSHD: Tensor,
    weights_BSH: Tensor,
    branch_index_BXD: Tensor,
) -> Tensor | None:
    """`longstraw.models.glm.dsa_selection` over a sharded prefix: [B, S, K] global positions
    (ascending, in [0, T + X)), or None when all are selected (the dense regime)."""
    batch, queries = q_BSHD.shape[:2]
    num_prefix, branch_len = layer.num_prefix, branch_index_BXD.shape[1]
    topk = indexer.index_topk
    if num_prefix + branch_len <= topk:
        return None
    parts = []
    if num_prefix > 0:
        parts = layer.gather_candidates(layer_idx, indexer, q_BSHD, weights_BSH)
    # The branch's own positions, scored and causally masked as the single-process selection.
    branch_BSX = index_scores(indexer, q_BSHD, weights_BSH, branch_index_BXD)
    query_pos = torch.arange(branch_len - queries, branch_len, device=q_BSHD.device)
    hidden_SX = torch.arange(branch_len, device=q_BSHD.device)[None, :] > query_pos[:, None]
    branch_BSX2 = torch.stack(
        [
            branch_BSX.masked_fill(hidden_SX, float("-inf")).double(),
            (num_prefix + torch.arange(branch_len, device=q_BSHD.device))
            .double()
            .expand(batch, queries, branch_len),
        ],
        dim=-1,
    )
    return global_topk(torch.cat([*parts, branch_BSX2], dim=2), topk)


# --- absorbed MLA over the sharded prefix ------------------------------------------------------


def _local_selection(selected_BSK: Tensor | None, local_start: int) -> Tensor | None:
    # Positions outside [0, T_r) after the shift fall outside every chunk (`_keep_chunk` drops them).
    return None if selected_BSK is None else selected_BSK - local_start


def _local_partial(q_lat_BHSR, q_rot_BHSE, lat_TR, rope_TE, selected_BSK, scale, grads, build):
    """(out, lse, (q_lat leaf, q_rot leaf) | None) of the queries over this rank's latents."""
    if not build:
        with torch.no_grad():
            out, lse = _PrefixLatentAttention.apply(
                q_lat_BHSR, q_rot_BHSE, lat_TR, rope_TE, selected_BSK, scale,
                glm.PREFIX_CHUNK_TOKENS, (None, None),
            )  # fmt: skip
        return out, lse, None
    with torch.enable_grad():
        q_lat = q_lat_BHSR.detach().requires_grad_(True)
        q_rot = q_rot_BHSE.detach().requires_grad_(True)
        out, lse = _PrefixLatentAttention.apply(
            q_lat, q_rot, lat_TR, rope_TE, selected_BSK, scale, glm.PREFIX_CHUNK_TOKENS, grads
        )
    return out, lse, (q_lat, q_rot)


def _local_backward(out_BHSR, lse_BHS, leaves, grad_out_BHSR, lse_m_BHS, delta_BHS):
    """This rank's (dq_lat, dq_rot) share given the MERGED prefix's dO, lse and delta; adds
    this rank's latent / rope-key cotangent through the op's own backward."""
    weight_BHS = torch.where(
        torch.isinf(lse_BHS),
        0.0,
        torch.exp(lse_BHS - lse_m_BHS.masked_fill(torch.isinf(lse_m_BHS), 0.0)),
    )
    grad_out = weight_BHS[..., None] * grad_out_BHSR
    grad_lse = weight_BHS * ((grad_out_BHSR * out_BHSR).sum(dim=-1) - delta_BHS)
    torch.autograd.backward((out_BHSR, lse_BHS), (grad_out, grad_lse))
    q_lat, q_rot = leaves
    return (
        torch.zeros_like(q_lat) if q_lat.grad is None else q_lat.grad,
        torch.zeros_like(q_rot) if q_rot.grad is None else q_rot.grad,
    )


def pack_partial(out_BHSR: Tensor, lse_BHS: Tensor) -> Tensor:
    """[B, H, S, R + 1]: a rank's partial as it travels."""
    return torch.cat([out_BHSR, lse_BHS[..., None]], dim=-1).contiguous()


def merged_partials(parts: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The ranks' packed partials (rank order) merged by log-sum-exp: the prefix (out, lse)."""
    return merge_partials([p[..., :-1] for p in parts], [p[..., -1] for p in parts])


def pack_latent_queries(q_lat_BHSR: Tensor, q_rot_BHSE: Tensor) -> Tensor:
    """[B, H, S, R + E]: the absorbed queries as they travel to serving ranks."""
    return torch.cat([q_lat_BHSR, q_rot_BHSE], dim=-1).contiguous()


def rank_partial(
    q_lat_BHSR, q_rot_BHSE, latent_TR, rope_TE, selected_BSK, local_start, scale, grads=None,
    needs_grad=False,
):  # fmt: skip
    """(out, lse, leaves) of the queries over one rank's latents [local_start, ...), restricted to
    the selected global positions it holds (the owner's own share and a serving rank's)."""
    return _local_partial(
        q_lat_BHSR, q_rot_BHSE, latent_TR, rope_TE, _local_selection(selected_BSK, local_start),
        scale, (None, None) if grads is None else grads, needs_grad,
    )  # fmt: skip


class _CrossRankLatentPrefix(torch.autograd.Function):
    """(out [B,H,S,R], lse [B,H,S]) of the queries over the whole (sharded) visible prefix."""

    @staticmethod
    def forward(ctx, q_lat_BHSR, q_rot_BHSE, layer, layer_idx, selected_BSK, scale, needs_grad):
        batch, heads, queries, _ = q_lat_BHSR.shape
        if layer.owner is not None:
            num_selected = 0 if selected_BSK is None else selected_BSK.shape[-1]
            header = (layer_idx, batch, heads, queries, num_selected, int(needs_grad))
            _broadcast(_header(OP_MLA_FORWARD, header), layer.owner, layer.group)
            _broadcast(pack_latent_queries(q_lat_BHSR, q_rot_BHSE), layer.owner, layer.group)
            if selected_BSK is not None:
                _broadcast(selected_BSK.contiguous(), layer.owner, layer.group)
        grads = (layer.grad_latent_TR, layer.grad_rope_TE)
        out_r, lse_r, leaves = rank_partial(
            q_lat_BHSR, q_rot_BHSE, layer.prefix_latent_TR, layer.prefix_rope_TE, selected_BSK,
            layer.local_start, scale, grads, needs_grad,
        )  # fmt: skip
        out_BHSR, lse_BHS = merged_partials(_all_gather(pack_partial(out_r, lse_r), layer.group))
        ctx.save_for_backward(out_BHSR, lse_BHS)
        # Query-sized: this rank's partial and its graph (the latents are the state's own views).
        ctx.local = (out_r, lse_r, leaves)
        ctx.layer, ctx.layer_idx = layer, layer_idx
        return out_BHSR, lse_BHS

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out_BHSR, grad_lse_BHS):
        out_BHSR, lse_BHS = ctx.saved_tensors
        layer = ctx.layer
        grad_out = torch.zeros_like(out_BHSR) if grad_out_BHSR is None else grad_out_BHSR.float()
        grad_lse = torch.zeros_like(lse_BHS) if grad_lse_BHS is None else grad_lse_BHS.float()
        delta_BHS = (grad_out * out_BHSR).sum(dim=-1) - grad_lse
        if layer.owner is not None:
            batch, heads, queries, _ = out_BHSR.shape
            header = (ctx.layer_idx, batch, heads, queries, 0, 0)
            _broadcast(_header(OP_MLA_BACKWARD, header), layer.owner, layer.group)
            packed = torch.cat([grad_out, lse_BHS[..., None], delta_BHS[..., None]], dim=-1)
            _broadcast(packed.contiguous(), layer.owner, layer.group)
        out_r, lse_r, leaves = ctx.local
        grad_q_lat, grad_q_rot = _local_backward(out_r, lse_r, leaves, grad_out, lse_BHS, delta_BHS)
        rank_dim = grad_q_lat.shape[-1]
        grad_q = _all_reduce(torch.cat([grad_q_lat, grad_q_rot], dim=-1).contiguous(), layer.group)
        return grad_q[..., :rank_dim], grad_q[..., rank_dim:], None, None, None, None, None


def sharded_latent_attention(
    q_lat_BHSR: Tensor,
    q_rot_BHSE: Tensor,
    latent_BXR: Tensor,
    rope_BXE: Tensor,
    layer: CrossRankMlaLayer,
    layer_idx: int,
    *,
    scale: float,
    selected_BSK: Tensor | None,
) -> Tensor:
    """`longstraw.ops.mla_attention.latent_attention` with the prefix partial across ranks."""
    num_prefix = layer.num_prefix
    q_lat, q_rot = q_lat_BHSR.float(), q_rot_BHSE.float()
    out, lse = branch_latent_partial(
        q_lat, q_rot, latent_BXR, rope_BXE, num_prefix, scale=scale, selected_BSK=selected_BSK
    )
    if num_prefix == 0:
        return out
    needs_grad = torch.is_grad_enabled() and (q_lat.requires_grad or q_rot.requires_grad)
    out_p, lse_p = layer.prefix_attention(q_lat, q_rot, layer_idx, selected_BSK, scale, needs_grad)
    return merge_partial_attention(out_p, lse_p, out, lse)[0]


def sharded_mla_forward(
    self: GlmMoeDsaAttention,
    hidden_states: Tensor,
    position_embeddings: tuple[Tensor, Tensor],
    attention_mask: Tensor | None = None,
    cache=None,
    position_ids: Tensor | None = None,
    prev_topk_indices: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None, Tensor | None]:
    """`longstraw_mla_forward` with the prefix read across ranks (a `CrossRankMlaLayer`)."""
    layer = None if cache is None else cache.layers[self.layer_idx]
    if not isinstance(layer, CrossRankMlaLayer):
        raise RuntimeError(
            "the sequence-sharded GLM attention needs a StateCache of CrossRankMlaLayer; run the "
            "model through longstraw.distributed"
        )
    batch, length = hidden_states.shape[:-1]
    inputs = mla_inputs(self, hidden_states, position_embeddings)
    latent_BXR, rope_BXE, index_BXD = layer.update(
        inputs.latent_BSR, inputs.rope_BSE, inputs.index_key_BSD
    )
    segment = isinstance(layer, SegmentMlaLayer)  # earlier segments: X > S with autograd
    if (
        latent_BXR.shape[1] != length
        and not segment
        and (layer.owner is not None or torch.is_grad_enabled())
    ):
        # Decoding (a kept overlay longer than this forward): the selection and the latent
        # attention below are already bottom-right aligned, as single-process; no backward.
        raise RuntimeError(
            "decoding over a sequence-sharded prefix runs replicated and without autograd "
            "(engine.rollout over CrossRankExchange); replay the sampled responses for gradients"
        )
    if self.indexer is not None:
        selected = sharded_dsa_selection(
            layer, self.layer_idx, self.indexer, inputs.index_q_BSHD, inputs.index_weights_BSH,
            index_BXD,
        )  # fmt: skip
    else:
        selected = previous_selection(self, prev_topk_indices)
    heads, nope_dim = inputs.q_nope_BHSN.shape[1], inputs.q_nope_BHSN.shape[-1]
    w_uk_HNR, w_uv_HVR = split_kv_b_weight(kv_b_weight(self), heads, nope_dim)
    q_lat_BHSR = torch.einsum("bhsn,hnr->bhsr", inputs.q_nope_BHSN, w_uk_HNR)
    out_lat_BHSR = sharded_latent_attention(
        q_lat_BHSR, inputs.q_rot_BHSE, latent_BXR, rope_BXE, layer, self.layer_idx,
        scale=self.scaling, selected_BSK=selected,
    )  # fmt: skip
    out_BHSV = torch.einsum("bhsr,hvr->bhsv", out_lat_BHSR.to(inputs.q_nope_BHSN.dtype), w_uv_HVR)
    out = out_BHSV.transpose(1, 2).reshape(batch, length, -1)
    return self.o_proj(out), None, selected


def attention_modules(model: PreTrainedModel) -> dict[int, GlmMoeDsaAttention]:
    """GLM's attention modules by layer index."""
    return {m.layer_idx: m for m in model.modules() if isinstance(m, GlmMoeDsaAttention)}


@contextlib.contextmanager
def cross_rank_mla_installed(model: PreTrainedModel) -> Iterator[None]:
    """Inside the block, every GLM attention module runs `sharded_mla_forward` and the MoE
    routers the engine's stable top-k (as `prefix_attention_enabled` does single-process)."""
    modules = attention_modules(model).values()
    with (
        forwards_replaced((m, sharded_mla_forward) for m in modules),
        stable_routing_installed(model),
    ):
        yield


def serve_mla_owner(
    model: PreTrainedModel,
    owner: int,
    prefix_latent_TR: list[Tensor],
    prefix_rope_TE: list[Tensor],
    prefix_index_TD: list[Tensor | None],
    *,
    local_start: int,
    group: dist.ProcessGroup | None = None,
    grad_latent_TR: list[Tensor] | None = None,
    grad_rope_TE: list[Tensor] | None = None,
    on_gradient_slices: Callable[[int, int], None] | None = None,
) -> int:
    """Serve an owner's GLM forward (and backward) until it says done; returns exchanges served.

    Lists are indexed by MLA storage slot (= model layer): the latents this rank contributes (all
    of its positions if it is before the owner, none if after) and, for a backward, its cotangent
    slices. `prefix_index_TD[slot]` is None on `shared` layers. `on_gradient_slices` answers the
    owner's `OP_GRADIENT_SLICES` headers, as in `serve_owner`.
    """
    modules = attention_modules(model)
    local: dict[int, tuple] = {}
    served = 0
    while True:
        header = _broadcast(_header(OP_DONE), owner, group)
        op, layer_idx, *dims = (int(x) for x in header)
        if op == OP_DONE:
            return served
        if op == OP_GRADIENT_SLICES:
            answer_gradient_slices(on_gradient_slices, owner, layer_idx)
            continue
        served += 1
        if op == OP_MLA_SELECT:
            batch, queries, heads, dim, _ = dims
            packed = _broadcast(torch.empty(batch, queries, heads, dim + 1), owner, group)
            with torch.no_grad():
                local_candidates = serve_candidates(
                    modules[layer_idx].indexer, packed, prefix_index_TD[layer_idx], local_start
                )
                _all_gather(local_candidates, group)
        elif op == OP_MLA_FORWARD:
            batch, heads, queries, num_selected, needs_grad = dims
            rank = prefix_latent_TR[layer_idx].shape[-1]
            rope = prefix_rope_TE[layer_idx].shape[-1]
            q = _broadcast(torch.empty(batch, heads, queries, rank + rope), owner, group)
            selected = None
            if num_selected:
                selected = _broadcast(
                    torch.empty(batch, queries, num_selected, dtype=torch.int64), owner, group
                )
            grads = (
                None if grad_latent_TR is None else grad_latent_TR[layer_idx],
                None if grad_rope_TE is None else grad_rope_TE[layer_idx],
            )
            module = modules[layer_idx]
            out_r, lse_r, leaves = rank_partial(
                q[..., :rank], q[..., rank:], prefix_latent_TR[layer_idx],
                prefix_rope_TE[layer_idx], selected, local_start, module.scaling, grads,
                bool(needs_grad),
            )  # fmt: skip
            _all_gather(pack_partial(out_r, lse_r), group)
            local[layer_idx] = (out_r, lse_r, leaves)
        else:
            assert op == OP_MLA_BACKWARD, f"unknown op {op} from the owner"
            batch, heads, queries, _, _ = dims
            out_r, lse_r, leaves = local.pop(layer_idx)
            rank = out_r.shape[-1]
            packed = _broadcast(torch.empty(batch, heads, queries, rank + 2), owner, group)
            grad_q_lat, grad_q_rot = _local_backward(
                out_r, lse_r, leaves, packed[..., :rank], packed[..., rank], packed[..., rank + 1]
            )
            _all_reduce(torch.cat([grad_q_lat, grad_q_rot], dim=-1).contiguous(), group)
