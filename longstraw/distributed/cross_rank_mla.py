"""The ranks' side of GLM-5's latent attention and DSA selection: `LatentRanks`.

Legend: B batch rows, H heads, S queries of this forward, T prefix positions visible to the
queries (global), T_r of them held by this rank, starting at global position `local_start`;
R latent rank, E rope dim, Hi / Di indexer heads / key dim, K `index_topk`, N ranks.

GLM's attention forward is one (`longstraw.models.glm.longstraw_mla_forward`) with its latent
attention the one op of `longstraw.ops.mla_attention`; on the ranks its cache layer carries a
`LatentRanks`, which moves what the forward hands it at the two places that read the prefix:

* **DSA selection is a GLOBAL top-k** (`longstraw.models.glm.dsa_selection`). Each rank scores
  the prefix positions it holds and keeps its local top-k as (score, global position) pairs
  (`local_topk_candidates`); one all_gather gives every participating rank N·K candidates per
  query (`gather_candidates`), from which, with the branch's own, the K best are the
  single-process selection. Per query, N·K candidates move — never a key.
* **Absorbed MLA over the prefix**: each rank's partial (out, lse) over its own latents,
  restricted to the selected positions it holds (`latent_prefix_partial`, the op's own), is
  gathered and merged in rank order (`gather`). Backward (FlashAttention-2): every rank gets the
  global (dO, lse, delta), adds d(latent), d(rope key) of ITS positions into its fp32 cotangent
  slice (`latent_prefix_backward`, the op's own), and the dq shares are all-reduced (`reduce`).
  No latent moves.

Modes as for K/V attention (`cross_rank_attention`): replicated (branch replay, decoding: every
rank runs the same forward, no headers) and owner (prefill / sweep: the owner broadcasts a
7-int header before each exchange, `serve_mla_owner` answers). Header layouts: select
`[op, layer, B, S, Hi, Di, 0]`, forward `[op, layer, B, H, S, K (0: dense), needs_grad]`,
backward `[op, layer, B, H, S, 0, 0]`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import PreTrainedModel
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention

from longstraw.distributed.cross_rank_attention import (
    COMM,
    OP_DONE,
    OP_GRADIENT_SLICES,
    _all_reduce_in_place,
    _broadcast,
    _gather_partials,
    _header,
    answer_gradient_slices,
)
from longstraw.models import glm
from longstraw.models.glm import local_topk_candidates
from longstraw.ops.mla_attention import latent_prefix_backward, latent_prefix_partial

# Header ops of the MLA exchanges (after cross_rank_attention's 0 forward, 1 backward, 2 done).
OP_MLA_SELECT, OP_MLA_FORWARD, OP_MLA_BACKWARD = 3, 4, 5


class LatentRanks:
    """An MLA layer's latent prefix split over the ranks of `group`
    (`longstraw.ops.mla_attention.LatentRanks`): this rank holds positions
    [local_start, local_start + T_r) of the `num_prefix` the queries see (the shard start in
    owner mode, the whole state in replay). `owner` None: replicated mode; otherwise the rank
    that runs the model; `layer` names the layer in the owner's headers."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        owner: int | None,
        layer: int,
        *,
        num_prefix: int,
        local_start: int,
    ):
        self.group, self.owner, self.layer = group, owner, layer
        self.num_prefix, self.local_start = num_prefix, local_start
        self.replicated = owner is None

    def _announce(self, op: int, *fields: int) -> None:
        if self.owner is not None:
            _broadcast(_header(op, (self.layer, *fields)), self.owner, self.group)

    def gather_candidates(
        self, indexer, q_BSHD: Tensor, weights_BSH: Tensor, index_TD: Tensor
    ) -> list[Tensor]:
        """Every rank's local top-k candidates [B, S, K, 2] for the indexer queries, in rank
        order (this rank's over `index_TD`, its positions)."""
        if self.owner is not None:
            batch, queries, heads, dim = q_BSHD.shape
            self._announce(OP_MLA_SELECT, batch, queries, heads, dim, 0)
            _broadcast(pack_index_queries(q_BSHD, weights_BSH), self.owner, self.group)
        local = local_topk_candidates(
            indexer, q_BSHD, weights_BSH, index_TD, self.local_start, indexer.index_topk
        )
        return _all_gather(local, self.group)

    def queries_ready(self, q_lat_BHSR, q_rot_BHSE, selected_BSK, needs_grad: bool) -> None:
        if self.owner is None:
            return
        batch, heads, queries, _ = q_lat_BHSR.shape
        num_selected = 0 if selected_BSK is None else selected_BSK.shape[-1]
        self._announce(OP_MLA_FORWARD, batch, heads, queries, num_selected, int(needs_grad))
        _broadcast(pack_latent_queries(q_lat_BHSR, q_rot_BHSE), self.owner, self.group)
        if selected_BSK is not None:
            _broadcast(selected_BSK.contiguous(), self.owner, self.group)

    def gather(self, out_BHSR: Tensor, lse_BHS: Tensor) -> list[tuple[Tensor, Tensor]]:
        return _gather_partials(out_BHSR, lse_BHS, self.group)

    def cotangent_ready(self, grad_out_BHSR: Tensor, lse_BHS: Tensor, delta_BHS: Tensor) -> None:
        if self.owner is None:
            return
        batch, heads, queries, _ = grad_out_BHSR.shape
        self._announce(OP_MLA_BACKWARD, batch, heads, queries, 0, 0)
        packed = torch.cat([grad_out_BHSR, lse_BHS[..., None], delta_BHS[..., None]], dim=-1)
        _broadcast(packed.contiguous(), self.owner, self.group)

    def reduce(self, tensors: list[Tensor]) -> None:
        _all_reduce_in_place(tensors, self.group)


def _all_gather(t: Tensor, group) -> list[Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    COMM.add(t)
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


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


def pack_latent_queries(q_lat_BHSR: Tensor, q_rot_BHSE: Tensor) -> Tensor:
    """[B, H, S, R + E]: the absorbed queries as they travel to serving ranks."""
    return torch.cat([q_lat_BHSR, q_rot_BHSE], dim=-1).contiguous()


def serve_latent_partial(
    packed_q_BHSX: Tensor, latent_TR, rope_TE, selected_BSK, local_start: int, scale: float
) -> tuple[Tensor, Tensor]:
    """A serving rank's partial (out, lse) for packed absorbed queries (`pack_latent_queries`)
    over its latents [local_start, ...)."""
    rank = latent_TR.shape[-1]
    return latent_prefix_partial(
        packed_q_BHSX[..., :rank], packed_q_BHSX[..., rank:], latent_TR, rope_TE, scale=scale,
        selected_BSK=selected_BSK, local_start=local_start, chunk_size=glm.PREFIX_CHUNK_TOKENS,
    )  # fmt: skip


def attention_modules(model: PreTrainedModel) -> dict[int, GlmMoeDsaAttention]:
    """GLM's attention modules by layer index."""
    return {m.layer_idx: m for m in model.modules() if isinstance(m, GlmMoeDsaAttention)}


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
    # The queries (and selection) of a forward that a backward will follow, by layer.
    saved: dict[int, tuple[Tensor, Tensor | None]] = {}
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
        latent, rope = prefix_latent_TR[layer_idx], prefix_rope_TE[layer_idx]
        rank = latent.shape[-1]
        scale = modules[layer_idx].scaling
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
            q = torch.empty(batch, heads, queries, rank + rope.shape[-1])
            q = _broadcast(q, owner, group)
            selected = None
            if num_selected:
                selected = _broadcast(
                    torch.empty(batch, queries, num_selected, dtype=torch.int64), owner, group
                )
            out, lse = serve_latent_partial(q, latent, rope, selected, local_start, scale)
            _gather_partials(out, lse, group)
            if needs_grad:
                saved[layer_idx] = (q, selected)
        else:
            assert op == OP_MLA_BACKWARD, f"unknown op {op} from the owner"
            batch, heads, queries, _, _ = dims
            q, selected = saved.pop(layer_idx)
            packed = _broadcast(torch.empty(batch, heads, queries, rank + 2), owner, group)
            dq_lat, dq_rot = latent_prefix_backward(
                packed[..., :rank], packed[..., rank], packed[..., rank + 1], q[..., :rank],
                q[..., rank:], latent, rope, scale=scale, selected_BSK=selected,
                local_start=local_start, chunk_size=glm.PREFIX_CHUNK_TOKENS,
                grad_latent_TR=None if grad_latent_TR is None else grad_latent_TR[layer_idx],
                grad_rope_TE=None if grad_rope_TE is None else grad_rope_TE[layer_idx],
            )  # fmt: skip
            _all_reduce_in_place([dq_lat, dq_rot], group)
