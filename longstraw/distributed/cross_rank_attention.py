"""Attention whose prefix keys live on several ranks: partials merged by log-sum-exp.

Legend: B batch rows, H query heads, K kv heads, R query rows, D head dim, V value dim,
T_r prefix keys held by rank r, N ranks.

Registered with transformers as attention function "longstraw_sharded"; the layer object in the
`StateCache` (a `CrossRankAttentionLayer`) says how the ranks cooperate:

* replicated (branch replay): every rank runs the same branch forward on the same inputs. Each
  computes its local prefix partial (out, lse); an all_gather gives every rank all N partials,
  merged in rank order, then the causal branch partial — so every rank holds the same output,
  bit for bit. Backward: each rank computes its share of dq from its own keys with the GLOBAL
  lse (FlashAttention-2 style) and adds its keys' dK/dV into its own cotangent slice; an
  all_reduce sums dq. No rank ever sees another rank's K/V.
* a long branch's segments (replicated): the branch's earlier segments are the same on every
  rank (`extra_prefix`); each rank computes their partial itself and merges it after the
  gathered prompt partials, and in backward adds their dK/dV into its own copy of the branch
  cotangent; only the prompt part of dq is all-reduced.
* decoding (rollout, replicated, no autograd): every rank runs the same batched decode step;
  the Q new queries' partial over this rank's prefix positions is all-gathered as in replay, and
  the branch overlay (kept by the layer, `keep_branch=True`) enters once, as the causal branch
  partial merged after the gather on every rank, exactly where replay merges the branch part.
* owner (prefill, reverse sweep): one rank (the shard's owner) runs the model; the others serve.
  Per full-attention layer the owner broadcasts a header and its scaled queries, every rank
  computes the partial over the positions it holds that are before the shard, all_gather, the
  owner merges. In backward the owner broadcasts (dO, lse, delta); each serving rank adds dK/dV
  for its positions into its own cotangent slice (the contributions for earlier ranks' K/V stay
  on those ranks) and the dq shares are all-reduced. A header before every exchange tells the
  servers what comes (forward / backward of a layer, or done), so they need not predict which
  layers autograd will visit.

Per exchange the communication is query-sized, never prefix-sized.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable
from transformers import AttentionInterface, PreTrainedModel

from longstraw.engine import attention
from longstraw.engine.attention import CACHE_KWARG
from longstraw.engine.cache import PrefixAttentionLayer
from longstraw.models.glm import is_glm
from longstraw.ops.partial_attention import (
    causal_partial,
    causal_partial_backward,
    merge_partials,
    prefix_partial,
    prefix_partial_backward,
)

ATTENTION_NAME = "longstraw_sharded"


def partial_chunk_tokens() -> int:
    """Prefix keys per chunk of the partial attention: the single-process kernels' grid
    (`engine.attention.PREFIX_CHUNK_TOKENS`, read at call time), which is also the unit a
    tiered slice streams in, so that a streamed prefix gives the resident bits."""
    return attention.PREFIX_CHUNK_TOKENS


# Header ops broadcast by the owner before each exchange (cross_rank_mla adds 3-5).
OP_FORWARD, OP_BACKWARD, OP_DONE = 0, 1, 2
# "The gradient slices of parameter `slot` follow" (sweep with sequence-sharded accumulators:
# `longstraw.distributed.gradient_slices`); the slot field carries the parameter's index.
OP_GRADIENT_SLICES = 6


class CommStats:
    """Bytes this process sent into collectives of the cross-rank attention (all kinds)."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.exchanges = 0

    def add(self, *tensors: Tensor) -> None:
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        self.exchanges += 1


COMM = CommStats()


class CrossRankAttentionLayer(PrefixAttentionLayer):
    """A full-attention layer whose visible prefix on THIS rank is `prefix_k_TKD` (maybe empty).

    `owner` None: replicated mode; otherwise the rank that runs the model (see module docstring).
    `keep_branch` (decoding, replicated only): keep the branch's own K/V between steps.
    `extra_prefix` (replicated only): a long branch's earlier segments, the same on every rank
    (`PrefixAttentionLayer`); each rank reads them itself, after the gathered prompt partials.
    """

    def __init__(
        self,
        prefix_k_TKD: Tensor,
        prefix_v_TKD: Tensor,
        *,
        group: dist.ProcessGroup | None,
        owner: int | None,
        slot: int = 0,
        grad_k_TKD: Tensor | None = None,
        grad_v_TKD: Tensor | None = None,
        on_update=None,
        keep_branch: bool = False,
        extra_prefix: tuple | None = None,
    ):
        if keep_branch and owner is not None:
            raise ValueError("decoding (keep_branch) runs replicated: pass owner=None")
        if extra_prefix is not None and owner is not None:
            raise ValueError("a branch's earlier segments are read replicated: pass owner=None")
        super().__init__(
            prefix_k_TKD,
            prefix_v_TKD,
            grad_k_TKD=grad_k_TKD,
            grad_v_TKD=grad_v_TKD,
            on_update=on_update,
            keep_branch=keep_branch,
            extra_prefix=extra_prefix,
        )
        self.group = group
        self.owner = owner
        # Storage slot of this full-attention layer: names it in the owner's headers.
        self.slot = slot


def _pack(out_BHRV: Tensor, lse_BHR: Tensor) -> Tensor:
    return torch.cat([out_BHRV, lse_BHR[..., None]], dim=-1).contiguous()


def _gather_partials(out_BHRV: Tensor, lse_BHR: Tensor, group) -> tuple[list[Tensor], list[Tensor]]:
    """Every rank's (out, lse) for the same queries, in rank order."""
    packed = _pack(out_BHRV, lse_BHR)
    parts = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    COMM.add(packed)
    dist.all_gather(parts, packed, group=group)
    return [p[..., :-1] for p in parts], [p[..., -1] for p in parts]


def _broadcast(t: Tensor, src: int, group) -> Tensor:
    """Broadcast from `src`, a rank OF `group` (not a global rank: groups may be subgroups)."""
    if dist.get_rank(group) == src:
        COMM.add(t)
    dist.broadcast(t, group=group, group_src=src)
    return t


def _all_reduce(t: Tensor, group) -> Tensor:
    COMM.add(t)
    dist.all_reduce(t, group=group)
    return t


def _header(op: int, shape: tuple[int, ...] = (0, 0, 0, 0, 0, 0)) -> Tensor:
    """[op, slot, B, H, R, D, V]: what the owner's next exchange is."""
    return torch.tensor([op, *shape], dtype=torch.int64)


class _CrossRankAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHRD, k_BKRD, v_BKRV, layer: CrossRankAttentionLayer, scale: float):
        dtype = torch.promote_types(q_BHRD.dtype, torch.float32)
        q_s = (q_BHRD.to(dtype) * scale).contiguous()
        batch, heads, length, dim = q_s.shape
        value_dim = v_BKRV.shape[-1]
        if layer.owner is not None:
            _broadcast(
                _header(OP_FORWARD, (layer.slot, batch, heads, length, dim, value_dim)),
                layer.owner,
                layer.group,
            )
            _broadcast(q_s, layer.owner, layer.group)
        out_p, lse_p = prefix_partial(
            q_s, layer.prefix_k_TKD, layer.prefix_v_TKD, chunk_size=partial_chunk_tokens()
        )
        outs, lses = _gather_partials(out_p, lse_p, layer.group)
        extra = layer.extra_prefix
        if extra is not None:
            out_e, lse_e = prefix_partial(
                q_s, extra[0], extra[1], chunk_size=partial_chunk_tokens()
            )
            outs, lses = [*outs, out_e], [*lses, lse_e]
        out_b, lse_b = causal_partial(q_s, k_BKRD, v_BKRV)
        out_BHRV, lse_BHR = merge_partials([*outs, out_b], [*lses, lse_b])
        ctx.save_for_backward(q_s, k_BKRD, v_BKRV, out_BHRV, lse_BHR)
        ctx.layer, ctx.scale, ctx.q_dtype = layer, scale, q_BHRD.dtype
        ctx.prefix_versions = (layer.prefix_k_TKD._version, layer.prefix_v_TKD._version)
        return out_BHRV.to(q_BHRD.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out_BHRV):
        q_s, k_BKRD, v_BKRV, out_BHRV, lse_BHR = ctx.saved_tensors
        layer = ctx.layer
        if (layer.prefix_k_TKD._version, layer.prefix_v_TKD._version) != ctx.prefix_versions:
            raise RuntimeError(
                "prefix K/V were modified in place while a graph that reads them lived"
            )
        grad_out = grad_out_BHRV.to(q_s.dtype).contiguous()
        delta_BHR = (grad_out * out_BHRV).sum(dim=-1)
        if layer.owner is not None:
            batch, heads, length, dim = q_s.shape
            _broadcast(
                _header(OP_BACKWARD, (layer.slot, batch, heads, length, dim, out_BHRV.shape[-1])),
                layer.owner,
                layer.group,
            )
            packed = torch.cat(
                [grad_out, lse_BHR[..., None], delta_BHR[..., None]], dim=-1
            ).contiguous()
            _broadcast(packed, layer.owner, layer.group)
        grad_q_s = prefix_partial_backward(
            q_s, grad_out, lse_BHR, delta_BHR, layer.prefix_k_TKD, layer.prefix_v_TKD,
            chunk_size=partial_chunk_tokens(), grad_k_TKD=layer.grad_k_TKD, grad_v_TKV=layer.grad_v_TKD,
        )  # fmt: skip
        _all_reduce(grad_q_s, layer.group)
        extra = layer.extra_prefix
        if extra is not None:
            # Replicated: every rank adds the same earlier-segment cotangent into its own copy
            # of the branch's, and its dq share needs no reduction.
            grad_q_s = grad_q_s + prefix_partial_backward(
                q_s, grad_out, lse_BHR, delta_BHR, extra[0], extra[1], chunk_size=partial_chunk_tokens(),
                grad_k_TKD=extra[2], grad_v_TKV=extra[3],
            )  # fmt: skip
        grad_q_b, grad_k, grad_v = causal_partial_backward(
            q_s, k_BKRD, v_BKRV, grad_out, lse_BHR, delta_BHR
        )
        grad_q = ((grad_q_s + grad_q_b) * ctx.scale).to(ctx.q_dtype)
        return grad_q, grad_k.to(k_BKRD.dtype), grad_v.to(v_BKRV.dtype), None, None


def serve_owner(
    owner: int,
    prefix_k_TKD: list[Tensor],
    prefix_v_TKD: list[Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    grad_k_TKD: list[Tensor] | None = None,
    grad_v_TKD: list[Tensor] | None = None,
    on_gradient_slices: Callable[[int, int], None] | None = None,
) -> int:
    """Serve an owner's forward (and backward) until it says done; returns exchanges served.

    Lists are indexed by full-attention storage slot: the prefix this rank contributes (all
    of its positions if it is before the owner, none if after) and, for a backward, its
    cotangent slices. `on_gradient_slices(owner, index)` answers an `OP_GRADIENT_SLICES`
    header (the owner's backward hands out parameter `index`'s gradient rows); it is not
    counted as an attention exchange.
    """
    saved_q: dict[int, Tensor] = {}
    served = 0
    while True:
        header = _broadcast(_header(OP_DONE), owner, group)
        op, slot, batch, heads, length, dim, value_dim = (int(x) for x in header)
        if op == OP_DONE:
            return served
        if op == OP_GRADIENT_SLICES:
            answer_gradient_slices(on_gradient_slices, owner, slot)
            continue
        served += 1
        if op == OP_FORWARD:
            q_s = _broadcast(torch.empty(batch, heads, length, dim), owner, group)
            out_p, lse_p = prefix_partial(
                q_s, prefix_k_TKD[slot], prefix_v_TKD[slot], chunk_size=partial_chunk_tokens()
            )
            _gather_partials(out_p, lse_p, group)
            saved_q[slot] = q_s
        else:
            assert op == OP_BACKWARD, f"unknown op {op} from the owner"
            # Autograd may skip a layer (nothing downstream needs it): the header names the slot.
            layer = slot
            q_s = saved_q.pop(slot)
            packed = _broadcast(torch.empty(batch, heads, length, value_dim + 2), owner, group)
            grad_q_s = prefix_partial_backward(
                q_s, packed[..., :value_dim], packed[..., value_dim], packed[..., value_dim + 1],
                prefix_k_TKD[layer], prefix_v_TKD[layer], chunk_size=partial_chunk_tokens(),
                grad_k_TKD=None if grad_k_TKD is None else grad_k_TKD[layer],
                grad_v_TKV=None if grad_v_TKD is None else grad_v_TKD[layer],
            )  # fmt: skip
            _all_reduce(grad_q_s, group)


def answer_gradient_slices(
    on_gradient_slices: Callable[[int, int], None] | None, owner: int, index: int
) -> None:
    """A server's side of an `OP_GRADIENT_SLICES` header (every serve loop shares it)."""
    if on_gradient_slices is None:
        raise RuntimeError(
            "the owner hands out gradient slices but this rank serves without a "
            "receiver: every rank of the group must call the same sweep function"
        )
    on_gradient_slices(owner, index)


def announce_gradient_slices(index: int, owner: int, group: dist.ProcessGroup | None) -> None:
    """The owner's header before it scatters the gradient rows of parameter `index`."""
    _broadcast(_header(OP_GRADIENT_SLICES, (index, 0, 0, 0, 0, 0)), owner, group)


def finish_owner(owner: int, group: dist.ProcessGroup | None = None) -> None:
    """The owner's last word to its servers."""
    _broadcast(_header(OP_DONE), owner, group)


def cross_rank_attention(
    module: torch.nn.Module,
    query_BHRD: Tensor,
    key_BKRD: Tensor,
    value_BKRV: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    cache = kwargs.get(CACHE_KWARG)
    layer = None if cache is None else cache.layers[module.layer_idx]
    if not isinstance(layer, CrossRankAttentionLayer):
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} needs a StateCache of "
            "CrossRankAttentionLayer passed as `longstraw_cache=`; run through longstraw.distributed"
        )
    scale = scaling if scaling is not None else query_BHRD.shape[-1] ** -0.5
    # Decoding (Q new queries over a longer kept overlay) runs the replay's forward: the causal
    # branch partial is bottom-right aligned. Its backward covers X = R only, so no autograd.
    decoding = key_BKRD.shape[2] != query_BHRD.shape[2]
    if decoding and (
        layer.owner is not None or (torch.is_grad_enabled() and query_BHRD.requires_grad)
    ):
        raise RuntimeError(
            "decoding over a sequence-sharded prefix runs replicated and without autograd "
            "(engine.rollout over CrossRankExchange); replay the sampled responses for gradients"
        )
    out_BHRV = _CrossRankAttention.apply(query_BHRD, key_BKRD, value_BKRV, layer, float(scale))
    return out_BHRV.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, cross_rank_attention)


def _cross_rank_layers_installed(model: PreTrainedModel) -> contextlib.AbstractContextManager:
    if not is_glm(model):
        return contextlib.nullcontext()
    # GLM-5's attention modules are replaced whole (latent prefix, global DSA top-k).
    from longstraw.distributed.cross_rank_mla import cross_rank_mla_installed

    return cross_rank_mla_installed(model)


def cross_rank_attention_enabled(model: PreTrainedModel) -> contextlib.AbstractContextManager:
    """Run `model`'s full-attention (and GLM MLA) layers across ranks inside the block."""
    return attention.attention_selected(model, ATTENTION_NAME, _cross_rank_layers_installed)
