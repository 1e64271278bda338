"""The ranks' side of the prompt attention: `prefix_cached_attention` with a `PrefixRanks`.

Legend: B batch rows, H query heads, K kv heads, R query rows, D head dim, V value dim,
T_r prefix keys held by rank r, N ranks.

Every rank holds a contiguous part of the prompt's positions; the attention is the one op of
`longstraw.ops.prefix_attention`, given this rank's part of the prefix and a `KvRanks`, which
moves what the op hands it (`PrefixRanks`: queries, partials, the backward's inputs, the dq
shares). Two ways the ranks cooperate:

* replicated (branch replay, a long branch's segments, decoding): every rank runs the same
  forward on the same inputs. Each computes the partial (out, lse) over its positions; an
  all_gather gives every rank all N partials, merged in rank order, then the rest of the op
  (a branch's earlier segments, which every rank holds, and the causal branch part) as on one
  process — so every rank holds the same output, bit for bit. Backward: each rank adds its
  positions' dK/dV into its own cotangent rows and an all_reduce sums the prompt's share of dq.
* owner (prefill, reverse sweep): one rank (the shard's owner) runs the model; the others serve
  (`serve_owner`). Per full-attention layer the owner broadcasts a header and its queries, every
  rank computes the partial over the positions it holds that are before the shard
  (`prefix_partial`, the op's own), all_gather, the owner merges. In backward the owner
  broadcasts (dO, out, lse); each serving rank adds dK/dV for its positions into its own
  cotangent rows (`prefix_backward`, the op's own) and the dq shares are all-reduced. A header
  before every exchange tells the servers what comes (forward / backward of a layer, or done),
  so they need not predict which layers autograd will visit.

Per exchange the communication is query-sized, never prefix-sized.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from longstraw.engine import attention
from longstraw.ops.prefix_attention import prefix_backward, prefix_partial


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
# Query dtypes a header can name (its last field is the index).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class CommStats:
    """Bytes this process sent into collectives of the cross-rank attention (all kinds)."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.exchanges = 0

    def add(self, *tensors: Tensor) -> None:
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        self.exchanges += 1


COMM = CommStats()


def pack_partial(out_BXRV: Tensor, lse_BXR: Tensor) -> Tensor:
    """[..., V + 1]: a partial (out, lse) as it travels between ranks."""
    return torch.cat([out_BXRV, lse_BXR[..., None]], dim=-1).contiguous()


def _gather_partials(out_BXRV: Tensor, lse_BXR: Tensor, group) -> list[tuple[Tensor, Tensor]]:
    """Every rank's (out, lse) for the same queries, in rank order."""
    packed = pack_partial(out_BXRV, lse_BXR)
    parts = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    COMM.add(packed)
    dist.all_gather(parts, packed, group=group)
    return [(p[..., :-1], p[..., -1]) for p in parts]


def _broadcast(t: Tensor, src: int, group) -> Tensor:
    """Broadcast from `src`, a rank OF `group` (not a global rank: groups may be subgroups)."""
    if dist.get_rank(group) == src:
        COMM.add(t)
    dist.broadcast(t, group=group, group_src=src)
    return t


def _all_reduce(t: Tensor, group) -> Tensor:
    # A strided tensor would be reduced in a copy and `t` left as it was (measured with gloo).
    assert t.is_contiguous(), "all_reduce in place needs a contiguous tensor"
    COMM.add(t)
    dist.all_reduce(t, group=group)
    return t


def _all_reduce_in_place(tensors: list[Tensor], group) -> None:
    """Sum `tensors` (any strides) over the ranks of `group` in place, in one all_reduce."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        _all_reduce(tensors[0], group)
        return
    flat = _all_reduce(torch.cat([t.reshape(-1) for t in tensors]), group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(part.view(t.shape))


def _header(op: int, shape: tuple[int, ...] = (0, 0, 0, 0, 0, 0)) -> Tensor:
    """[op, slot, 5 fields]: what the owner's next exchange is."""
    return torch.tensor([op, *shape], dtype=torch.int64)


class KvRanks:
    """A full-attention layer's prompt prefix split over the ranks of `group` (`PrefixRanks`).

    `owner` None: replicated mode; otherwise the rank that runs the model, the others serving
    it (`serve_owner`); `slot` (the layer's full-attention storage slot) names the layer in the
    owner's headers."""

    def __init__(self, group: dist.ProcessGroup | None, owner: int | None = None, slot: int = 0):
        self.group, self.owner, self.slot = group, owner, slot
        self.replicated = owner is None

    def _announce(self, op: int, q_BHRD: Tensor) -> None:
        batch, heads, length, dim = q_BHRD.shape
        fields = (self.slot, batch, heads, length, dim, _DTYPES.index(q_BHRD.dtype))
        _broadcast(_header(op, fields), self.owner, self.group)

    def queries_ready(self, q_BHRD: Tensor, scale: float) -> None:
        # The servers scale the queries by the layer's own scale (`models.adapters.attention_scales`).
        del scale
        if self.owner is not None:
            self._announce(OP_FORWARD, q_BHRD)
            _broadcast(q_BHRD.contiguous(), self.owner, self.group)

    def gather(self, out_BXRV: Tensor, lse_BXR: Tensor) -> list[tuple[Tensor, Tensor]]:
        return _gather_partials(out_BXRV, lse_BXR, self.group)

    def cotangent_ready(self, grad_out_BHRV: Tensor, out_BHRV: Tensor, lse_BHR: Tensor) -> None:
        if self.owner is not None:
            self._announce(OP_BACKWARD, out_BHRV)
            _broadcast(_pack_cotangent(grad_out_BHRV, out_BHRV, lse_BHR), self.owner, self.group)

    def reduce(self, tensors: list[Tensor]) -> None:
        _all_reduce_in_place(tensors, self.group)


def _pack_cotangent(grad_out_BHRV: Tensor, out_BHRV: Tensor, lse_BHR: Tensor) -> Tensor:
    """[B, H, R, 2V + 1] in the lse's dtype (fp32 or wider: exact for the outputs' dtype)."""
    dtype = lse_BHR.dtype
    return torch.cat(
        [grad_out_BHRV.to(dtype), out_BHRV.to(dtype), lse_BHR[..., None]], dim=-1
    ).contiguous()


def serve_owner(
    owner: int,
    prefix_k_TKD: list[Tensor],
    prefix_v_TKD: list[Tensor],
    scales: list[float],
    *,
    group: dist.ProcessGroup | None = None,
    grad_k_TKD: list[Tensor] | None = None,
    grad_v_TKD: list[Tensor] | None = None,
    on_gradient_slices: Callable[[int, int], None] | None = None,
) -> int:
    """Serve an owner's forward (and backward) until it says done; returns exchanges served.

    Lists are indexed by full-attention storage slot: the prefix this rank contributes (all
    of its positions if it is before the owner, none if after), the layer's softmax scale and,
    for a backward, its cotangent slices. `on_gradient_slices(owner, index)` answers an
    `OP_GRADIENT_SLICES` header (the owner's backward hands out parameter `index`'s gradient
    rows); it is not counted as an attention exchange.
    """
    saved_q: dict[int, Tensor] = {}
    served = 0
    while True:
        header = _broadcast(_header(OP_DONE), owner, group)
        op, slot, batch, heads, length, dim, dtype_index = (int(x) for x in header)
        if op == OP_DONE:
            return served
        if op == OP_GRADIENT_SLICES:
            answer_gradient_slices(on_gradient_slices, owner, slot)
            continue
        served += 1
        dtype = _DTYPES[dtype_index]
        keys, values = prefix_k_TKD[slot], prefix_v_TKD[slot]
        if op == OP_FORWARD:
            q_BHRD = _broadcast(torch.empty(batch, heads, length, dim, dtype=dtype), owner, group)
            out, lse = prefix_partial(
                q_BHRD, keys, values, scale=scales[slot], chunk_size=partial_chunk_tokens()
            )
            _gather_partials(out, lse, group)
            saved_q[slot] = q_BHRD
            continue
        assert op == OP_BACKWARD, f"unknown op {op} from the owner"
        # Autograd may skip a layer (nothing downstream needs it): the header names the slot.
        q_BHRD = saved_q.pop(slot)
        value_dim = values.shape[-1]
        packed = torch.empty(batch, heads, length, 2 * value_dim + 1, dtype=_lse_dtype(dtype))
        packed = _broadcast(packed, owner, group)
        grad_out_BHRV = packed[..., :value_dim].to(dtype).contiguous()
        out_BHRV = packed[..., value_dim:-1].to(dtype).contiguous()
        prefix_backward(
            grad_out_BHRV, q_BHRD, out_BHRV, packed[..., -1].contiguous(), keys, values,
            scale=scales[slot], chunk_size=partial_chunk_tokens(),
            grad_k_TKD=None if grad_k_TKD is None else grad_k_TKD[slot],
            grad_v_TKV=None if grad_v_TKD is None else grad_v_TKD[slot],
            ranks=KvRanks(group, owner, slot),
        )  # fmt: skip


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


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
