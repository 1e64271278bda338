"""Prefix-cached attention: branch queries over [frozen prefix ; causal branch], never copying the prefix.

Shape legend:
    B batch rows (samples of one prompt), H query heads, K kv heads (H % K == 0),
    G = H // K query heads per kv head, R branch length (or prefill shard length),
    T prefix length (may be 0), D query/key head dim, V value head dim (may differ from D),
    N rows of one query chunk with the G heads of a kv group folded in (G * chunk rows),
    M = B * N (all rows of a query chunk that read the same prefix kv head), C keys of one chunk.
    Value tensors keep the `_BKRD`/`_TKD` suffix of the public API; their last dim is V.

The prefix K/V are the prompt state ([T, K, D], no batch dim, shared by all B rows). They are
read chunk by chunk, never concatenated, copied whole or saved for backward: autograd keeps
them as ctx attributes (they live anyway as the state) and backward re-reads them. In exact
mode the prefix gradient is *added* into caller-owned fp32 buffers, so accumulating the prompt
cotangent over many branches allocates nothing prefix-sized.

Internally every branch-sized tensor is laid out kv-head-major, [K, B, ...]: then the B * G query
rows of one kv head are one matrix, and each prefix chunk costs one bmm over K, with no copy of
the prefix chunk per batch row or per head.

The forward's kernels are chosen by `longstraw.ops.dispatch`: on CPU PyTorch's fused flash kernel
computes both partials; on CUDA with flash-attn installed (bf16/fp16) flash-attn computes the
prefix partial chunk by chunk and the branch partial is the pure-torch loop below; otherwise the
pure-torch loop computes both. The backward is PyTorch's fused CPU flash backward for fp32 on
CPU and the pure-torch loop below otherwise: flash-attn's backward cannot add the prefix dK/dV
into an external buffer without materialising a prefix-sized tensor. The flash-attn path has
not run on a GPU yet.

The same op serves one process and the ranks of a sequence group, where each rank holds a
contiguous part of the prompt's positions (`ranks`, a `PrefixRanks`; None on one process): every
rank computes the partial attention of the queries over its own positions, the partials are
gathered and merged in rank order into the prompt's, and the rest is as on one process. The
backward needs only the global output and log-sum-exp, so each rank adds the dK/dV of its own
positions into its own cotangent rows and the ranks sum their shares of dq: no rank sees another
rank's K/V, and what moves is query-sized.
"""

from typing import Protocol

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from longstraw.ops import dispatch
from longstraw.ops.partial_attention import (
    flash_prefix_partial,
    merge_partial_attention,
    merge_partials,
)

# --------------------------------------------------------------------------------------------
# Forward pieces. One query chunk arrives pre-scaled (q * scale, so scores need no extra pass)
# in the compute dtype; the running online-softmax state is (row max, row sum, unnormalised out).


def _online_softmax_step(
    max_xN: Tensor, sum_xN: Tensor, acc_xNV: Tensor, scores_xNC: Tensor, v_xCV: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    new_max_xN = torch.maximum(max_xN, scores_xNC.amax(dim=-1))
    rescale_xN = torch.exp(max_xN - new_max_xN)
    probs_xNC = scores_xNC.sub_(new_max_xN[..., None]).exp_()  # scores are a fresh temporary
    new_sum_xN = sum_xN * rescale_xN + probs_xNC.sum(dim=-1)
    new_acc_xNV = (acc_xNV * rescale_xN[..., None]).add_(probs_xNC @ v_xCV)
    return new_max_xN, new_sum_xN, new_acc_xNV


def _empty_state(q_xND: Tensor, value_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    rows_shape = q_xND.shape[:-1]
    return (
        q_xND.new_full(rows_shape, float("-inf")),
        q_xND.new_zeros(rows_shape),
        q_xND.new_zeros((*rows_shape, value_dim)),
    )


def _finish(max_xN: Tensor, sum_xN: Tensor, acc_xNV: Tensor) -> tuple[Tensor, Tensor]:
    return acc_xNV / sum_xN[..., None], max_xN + torch.log(sum_xN)


def _prefix_partial(
    q_KMD: Tensor, k_prefix_TKD: Tensor, v_prefix_TKD: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Attention of pre-scaled query rows over all prefix keys; requires T > 0."""
    state = _empty_state(q_KMD, v_prefix_TKD.shape[-1])
    for start in range(0, k_prefix_TKD.shape[0], chunk_size):
        # .to() copies one chunk at most (none when the state is already in the compute dtype);
        # the transposes are views that bmm reads with strides.
        k_KCD = k_prefix_TKD[start : start + chunk_size].to(q_KMD.dtype).transpose(0, 1)
        v_KCV = v_prefix_TKD[start : start + chunk_size].to(q_KMD.dtype).transpose(0, 1)
        state = _online_softmax_step(*state, q_KMD @ k_KCD.transpose(-1, -2), v_KCV)
    return _finish(*state)


def _hidden_NC(
    query_start: int, query_end: int, key_start: int, key_end: int, num_groups: int, device
) -> Tensor:
    """True where a (group-folded) query row may NOT see a key: key position > query position."""
    query_pos_N = torch.arange(query_start, query_end, device=device).repeat(num_groups)
    key_pos_C = torch.arange(key_start, key_end, device=device)
    return key_pos_C[None, :] > query_pos_N[:, None]


def _branch_partial(
    q_KBND: Tensor,
    k_KBRD: Tensor,
    v_KBRV: Tensor,
    query_start: int,
    query_end: int,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """Causal attention of branch queries [query_start, query_end) over branch keys 0..query."""
    num_groups = q_KBND.shape[2] // (query_end - query_start)
    state = _empty_state(q_KBND, v_KBRV.shape[-1])
    # Key 0 is in the first chunk and visible to every query, so no row's max stays -inf.
    for key_start in range(0, query_end, chunk_size):
        key_end = min(key_start + chunk_size, k_KBRD.shape[2])
        scores_KBNC = q_KBND @ k_KBRD[:, :, key_start:key_end].transpose(-1, -2)
        if key_end - 1 > query_start:
            hidden_NC = _hidden_NC(
                query_start, query_end, key_start, key_end, num_groups, q_KBND.device
            )
            scores_KBNC.masked_fill_(hidden_NC, float("-inf"))
        state = _online_softmax_step(*state, scores_KBNC, v_KBRV[:, :, key_start:key_end])
    return _finish(*state)


# Query rows per chunk in the backward (see `_PrefixCachedAttention.backward`).
BACKWARD_QUERY_CHUNK = 256


def _query_chunks(branch_len: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_size, branch_len)) for s in range(0, branch_len, chunk_size)]


def _fold(x_BHRX: Tensor, num_kv_heads: int, start: int, end: int, dtype) -> Tensor:
    """Rows [start, end) of [B, H, R, X] as a contiguous [K, B, G * rows, X] block in `dtype`.

    May share storage with `x_BHRX` (B = 1, fp32): read it, never write it in place.
    """
    batch, num_heads, branch_len, dim = x_BHRX.shape
    num_groups = num_heads // num_kv_heads
    x_BKGRX = x_BHRX.view(batch, num_kv_heads, num_groups, branch_len, dim)[:, :, :, start:end]
    x_KBNX = x_BKGRX.transpose(0, 1).reshape(num_kv_heads, batch, num_groups * (end - start), dim)
    return x_KBNX.to(dtype).contiguous()


def _unfold(x_KBNX: Tensor, num_groups: int) -> Tensor:
    """Inverse of `_fold` for one chunk: [K, B, G * rows, X] -> [B, K, G, rows, X] (a view)."""
    num_kv_heads, batch, rows, dim = x_KBNX.shape
    return x_KBNX.view(num_kv_heads, batch, num_groups, rows // num_groups, dim).transpose(0, 1)


def _kv_head_major(x_BKRX: Tensor, dtype) -> Tensor:
    """Branch K or V as contiguous [K, B, R, X] in `dtype`; may share storage with the input."""
    return x_BKRX.transpose(0, 1).to(dtype).contiguous()


def _add_product(acc_KXY: Tensor | None, a_KXZ: Tensor, b_KZY: Tensor) -> Tensor:
    """acc + a @ b with the add fused into the GEMM; the first product needs no zero-filled acc."""
    if acc_KXY is None:
        return torch.bmm(a_KXZ, b_KZY)
    return acc_KXY.baddbmm_(a_KXZ, b_KZY)


# PyTorch's CPU flash-attention kernel returns the log-sum-exp beside the output, so both partials
# (prefix: every key visible; branch: causal) come from fused C++ code and only the merge is ours.
# Measured 4.7x faster than the chunked Python loop at T=8192, R=1024 (fp32, 2 cores).
_CPU_FLASH = dispatch.CPU_FLASH


class PrefixRanks(Protocol):
    """The ranks that hold the rest of the prompt prefix, where this process holds a part of it
    (`longstraw.distributed` builds one per layer; None on one process). The op calls it at
    four points and computes everything else itself: the partial over the positions this
    process holds (`prefix_partial`) and their share of the backward (`prefix_backward`), which
    every other rank computes over its own positions with the same functions."""

    replicated: bool
    """Every rank runs this same forward (a branch, a decode step); else one rank runs it and
    the others serve it (a prefill or sweep shard)."""

    def queries_ready(self, q_BHRD: Tensor, scale: float) -> None:
        """The queries are known, before this rank's partial is computed."""

    def gather(self, out_BXRV: Tensor, lse_BXR: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Every rank's (out, lse) of the queries over its positions, this rank's among them,
        in rank order (in the layout `out` and `lse` have)."""

    def cotangent_ready(self, grad_out_BHRV: Tensor, out_BHRV: Tensor, lse_BHR: Tensor) -> None:
        """The backward's inputs are known (the global output and log-sum-exp), before this
        rank's share of the prompt's gradient is computed."""

    def reduce(self, tensors: list[Tensor]) -> None:
        """Sum `tensors` (the prompt's share of dq) over the ranks, in place."""


def _forward_kernel(q_BHRD: Tensor, value_dim: int, kv_dtypes: tuple) -> str:
    """`aten-cpu-flash`: both partials fused; `flash-attn`: the prefix partials by flash-attn,
    the branch by the loop; `torch`: both by the loop (`longstraw.ops.dispatch`)."""
    return dispatch.attention_kernel(
        q_BHRD.device, q_BHRD.dtype, q_BHRD.shape[-1], value_dim,
        () if q_BHRD.device.type == "cpu" else kv_dtypes,
    )  # fmt: skip


def _compute_dtype(q_BHRD: Tensor) -> torch.dtype:
    # Accumulate in fp32 for bf16/fp16 inputs; fp64 stays fp64 (lets gradcheck run).
    return torch.promote_types(q_BHRD.dtype, torch.float32)


def _prefix_partial_of_kernel(
    q_BHRD: Tensor, k_TKD, v_TKV, scale: float, chunk_size: int, kernel: str
) -> tuple[Tensor, Tensor]:
    """(out_BHRV, lse_BHR) in the compute dtype of the queries over all T keys (T = 0: out 0,
    lse -inf, no kernel), by `kernel`: one fused call per `chunk_size` keys, merged in order
    (`flash_prefix_partial`), or the loop's online softmax, per query chunk of `chunk_size`
    rows as the forward's loop merges them."""
    batch, num_heads, branch_len, _ = q_BHRD.shape
    value_dim = v_TKV.shape[-1]
    if k_TKD.shape[0] > 0 and kernel != dispatch.TORCH:
        return flash_prefix_partial(q_BHRD, k_TKD, v_TKV, scale, chunk_size, kernel=kernel)
    dtype = _compute_dtype(q_BHRD)
    out_BHRV = q_BHRD.new_zeros((batch, num_heads, branch_len, value_dim), dtype=dtype)
    lse_BHR = q_BHRD.new_full((batch, num_heads, branch_len), float("-inf"), dtype=dtype)
    if k_TKD.shape[0] == 0:
        return out_BHRV, lse_BHR
    dispatch.ran("full_attention.prefix", dispatch.TORCH)
    num_kv_heads = k_TKD.shape[1]
    num_groups = num_heads // num_kv_heads
    out_BKGRV = out_BHRV.view(batch, num_kv_heads, num_groups, branch_len, value_dim)
    lse_BKGR = lse_BHR.view(batch, num_kv_heads, num_groups, branch_len)
    for start, end in _query_chunks(branch_len, chunk_size):
        q_KBND = _fold(q_BHRD, num_kv_heads, start, end, dtype) * scale
        # All B * G rows of a kv head read the same prefix head: one [M, D] matrix.
        out_KMV, lse_KM = _prefix_partial(q_KBND.flatten(1, 2), k_TKD, v_TKV, chunk_size)
        out_BKGRV[:, :, :, start:end] = _unfold(out_KMV.view(*q_KBND.shape[:3], -1), num_groups)
        lse_BKGR[:, :, :, start:end] = _unfold(lse_KM.view(*q_KBND.shape[:3], 1), num_groups)[
            ..., 0
        ]
    return out_BHRV, lse_BHR


def prefix_partial(
    q_BHRD: Tensor, k_TKD, v_TKV, *, scale: float, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """(out_BHRV, lse_BHR) fp32 or wider: attention of the queries over all T keys of one
    prefix (every key visible; T = 0: out 0, lse -inf), with the kernel
    `prefix_cached_attention` runs for these queries. A rank of a sequence group computes its
    share of a prompt's attention with it; the shares merge by log-sum-exp (`merge_partials`)."""
    kernel = _forward_kernel(q_BHRD, v_TKV.shape[-1], (k_TKD.dtype, v_TKV.dtype))
    return _prefix_partial_of_kernel(q_BHRD, k_TKD, v_TKV, scale, chunk_size, kernel)


def _branch_partial_fused(
    q_BHRD: Tensor, k_branch_BKRD: Tensor, v_branch_BKRD: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """(out_BHRV fp32, lse_BHR fp32) of the causal branch part by the CPU flash kernel (GQA
    resolved inside it: query head h reads kv head h // (H // K))."""
    dispatch.ran("full_attention.branch", dispatch.ATEN_CPU_FLASH)
    out_b, lse_b = _CPU_FLASH(
        q_BHRD, k_branch_BKRD, v_branch_BKRD, 0.0, True, attn_mask=None, scale=scale
    )[:2]
    return out_b.float(), lse_b.float()


def _prefixes(k_TKD, v_TKD, grad_k_TKD, grad_v_TKD, extra_prefix) -> list[tuple]:
    """Every prefix as (k, v, grad_k, grad_v): the prompt's, then an optional second one (a long
    branch's own earlier segments, `longstraw.engine.segmented_replay`)."""
    prefixes = [(k_TKD, v_TKD, grad_k_TKD, grad_v_TKD)]
    if extra_prefix is not None:
        prefixes.append(tuple(extra_prefix))
    return prefixes


def _prefix_partials(
    q_BHRD: Tensor, prefixes: list, scale: float, chunk_size: int, kernel: str, ranks
) -> list[tuple[Tensor, Tensor] | None]:
    """Each prefix's (out_BHRV, lse_BHR) over all queries (None: no keys): the prompt's merged
    over the ranks that hold it (`ranks`), in rank order."""
    partials: list[tuple[Tensor, Tensor] | None] = []
    for i, (k_TKD, v_TKD, _, _) in enumerate(prefixes):
        if i == 0 and ranks is not None:
            ranks.queries_ready(q_BHRD, scale)
            own = _prefix_partial_of_kernel(q_BHRD, k_TKD, v_TKD, scale, chunk_size, kernel)
            outs, lses = zip(*ranks.gather(*own), strict=True)
            partials.append(merge_partials(list(outs), list(lses)))
        elif k_TKD.shape[0] == 0:
            partials.append(None)
        else:
            partials.append(
                _prefix_partial_of_kernel(q_BHRD, k_TKD, v_TKD, scale, chunk_size, kernel)
            )
    return partials


def _attention_outputs(
    q_BHRD: Tensor,
    k_branch_BKRD: Tensor,
    v_branch_BKRD: Tensor,
    prefixes: list,
    scale: float,
    chunk_size: int,
    ranks: PrefixRanks | None,
) -> tuple[Tensor, Tensor]:
    """(out_BHRV in q's dtype, lse_BKGR fp32 or wider) of the branch queries over every prefix
    of `prefixes` ((k, v, grad_k, grad_v) each) and the branch keys, causally.

    Each prefix's partial is computed over all queries first (`_prefix_partials`, on the fixed
    chunk grid a streamed state is read on), then merged into the branch partial, prefixes last
    to first (one prefix: merge(prefix, branch)): by the CPU flash kernel the branch partial of
    all queries at once, otherwise query chunk by query chunk with the loop's."""
    batch, num_heads, branch_len, _ = q_BHRD.shape
    num_kv_heads = k_branch_BKRD.shape[1]
    num_groups = num_heads // num_kv_heads
    value_dim = v_branch_BKRD.shape[-1]
    dtype = _compute_dtype(q_BHRD)
    kv_dtypes = tuple(t.dtype for k, v, _, _ in prefixes if k.shape[0] > 0 for t in (k, v))
    kernel = _forward_kernel(q_BHRD, value_dim, kv_dtypes)
    partials = _prefix_partials(q_BHRD, prefixes, scale, chunk_size, kernel, ranks)
    if kernel == dispatch.ATEN_CPU_FLASH:
        out, lse = _branch_partial_fused(q_BHRD, k_branch_BKRD, v_branch_BKRD, scale)
        for partial in reversed(partials):
            if partial is not None:
                out, lse = merge_partial_attention(*partial, out, lse)
        shape = (batch, num_kv_heads, num_groups, branch_len)
        return out.to(q_BHRD.dtype), lse.view(shape)

    dispatch.ran("full_attention.branch", dispatch.TORCH)
    k_KBRD = _kv_head_major(k_branch_BKRD, dtype)
    v_KBRV = _kv_head_major(v_branch_BKRD, dtype)
    out_BKGRV = q_BHRD.new_empty(
        (batch, num_kv_heads, num_groups, branch_len, value_dim), dtype=dtype
    )
    lse_BKGR = q_BHRD.new_empty((batch, num_kv_heads, num_groups, branch_len), dtype=dtype)
    for start, end in _query_chunks(branch_len, chunk_size):
        q_KBND = _fold(q_BHRD, num_kv_heads, start, end, dtype) * scale
        out_KBNV, lse_KBN = _branch_partial(q_KBND, k_KBRD, v_KBRV, start, end, chunk_size)
        for partial in reversed(partials):
            if partial is None:
                continue
            out_p_BHRV, lse_p_BHR = partial
            out_p_KBNV = _fold(out_p_BHRV, num_kv_heads, start, end, dtype)
            lse_p_KBN = _fold(lse_p_BHR[..., None], num_kv_heads, start, end, dtype)[..., 0]
            out_KBNV, lse_KBN = merge_partial_attention(out_p_KBNV, lse_p_KBN, out_KBNV, lse_KBN)
        out_BKGRV[:, :, :, start:end] = _unfold(out_KBNV, num_groups)
        lse_BKGR[:, :, :, start:end] = _unfold(lse_KBN[..., None], num_groups)[..., 0]

    return out_BKGRV.view(batch, num_heads, branch_len, value_dim).to(q_BHRD.dtype), lse_BKGR


# PyTorch's fused CPU flash backward: given the output and log-sum-exp of the whole attention,
# its call over one chunk of keys returns that chunk's share of dq and the chunk's dK/dV
# (FlashAttention-2's backward: dS = P * (dP - rowsum(dO * O)) with the global softmax).
_CPU_FLASH_BACKWARD = dispatch.CPU_FLASH_BACKWARD


class _FusedBackward:
    """The backward by PyTorch's fused CPU kernel (fp32): one call per `chunk_size` prefix keys,
    on the same grid as the forward (a streamed state hands one chunk at a time), each prefix's
    dK/dV added into its buffers (summed over batch rows), then one causal call over the
    branch. Every call rebuilds its scores inside the kernel, block by block; nothing
    prefix- or [queries, keys]-sized is allocated."""

    def __init__(self, grad_out_BHRV, q_BHRD, out_BHRV, lse_BHR, scale, chunk_size):
        self.grad_out_BHRV = grad_out_BHRV.contiguous()
        self.q_BHRD, self.out_BHRV, self.lse_BHR = q_BHRD, out_BHRV, lse_BHR
        self.scale, self.chunk_size = scale, chunk_size
        self.grad_q_BHRD: Tensor | None = None

    def _call(self, k_BKXD: Tensor, v_BKXV: Tensor, causal: bool) -> tuple:
        return _CPU_FLASH_BACKWARD(
            self.grad_out_BHRV, self.q_BHRD, k_BKXD, v_BKXV, self.out_BHRV, self.lse_BHR,
            0.0, causal, attn_mask=None, scale=self.scale,
        )  # fmt: skip

    def _add_grad_q(self, grad_q_BHRD: Tensor) -> None:
        if self.grad_q_BHRD is None:
            self.grad_q_BHRD = grad_q_BHRD
        else:
            self.grad_q_BHRD.add_(grad_q_BHRD)

    def add_prefix(self, k_prefix_TKD, v_prefix_TKD, grad_k_TKD, grad_v_TKD) -> None:
        q_BHRD, chunk_size = self.q_BHRD, self.chunk_size
        batch = q_BHRD.shape[0]
        for key_start in range(0, k_prefix_TKD.shape[0], chunk_size):
            key_end = min(key_start + chunk_size, k_prefix_TKD.shape[0])
            k_BKCD = k_prefix_TKD[key_start:key_end].to(q_BHRD.dtype).permute(1, 0, 2)[None]
            v_BKCV = v_prefix_TKD[key_start:key_end].to(q_BHRD.dtype).permute(1, 0, 2)[None]
            grad_q_c, grad_k_BKCD, grad_v_BKCV = self._call(
                k_BKCD.expand(batch, -1, -1, -1), v_BKCV.expand(batch, -1, -1, -1), False
            )
            self._add_grad_q(grad_q_c)
            if grad_k_TKD is not None:
                grad_k_TKD[key_start:key_end].add_(grad_k_BKCD.sum(0).transpose(0, 1))
            if grad_v_TKD is not None:
                grad_v_TKD[key_start:key_end].add_(grad_v_BKCV.sum(0).transpose(0, 1))

    def reduce(self, ranks: PrefixRanks) -> None:
        if self.grad_q_BHRD is None:
            self.grad_q_BHRD = torch.zeros_like(self.q_BHRD)
        ranks.reduce([self.grad_q_BHRD])

    def finish(self, k_branch_BKRD: Tensor, v_branch_BKRD: Tensor) -> tuple[Tensor, ...]:
        """(dq, dk_branch, dv_branch) with the branch's part added."""
        grad_q_b, grad_k_BKRD, grad_v_BKRV = self._call(k_branch_BKRD, v_branch_BKRD, True)
        self._add_grad_q(grad_q_b)
        return (
            self.grad_q_BHRD.to(self.q_BHRD.dtype),
            grad_k_BKRD.to(k_branch_BKRD.dtype),
            grad_v_BKRV.to(v_branch_BKRD.dtype),
        )


class _LoopBackward:
    """LongStraw's backward loop (any dtype, any device), FlashAttention-2's algorithm per query
    chunk in the [K, B, N, X] layout of the forward; q pre-scaled as there. Query chunks are at
    most `BACKWARD_QUERY_CHUNK` rows: the backward holds about four [K, B * G * rows,
    chunk_size] score blocks at once, which for the thousands of queries of a recomputed prefill
    shard would otherwise be the largest thing in the sweep."""

    def __init__(self, grad_out_BHRV, q_BHRD, out_BHRV, lse_BHR, scale, chunk_size, num_kv_heads):
        batch, num_heads, branch_len, _ = q_BHRD.shape
        self.q_BHRD, self.scale, self.chunk_size = q_BHRD, scale, chunk_size
        self.num_kv_heads, self.num_groups = num_kv_heads, num_heads // num_kv_heads
        self.dtype = dtype = lse_BHR.dtype
        lse_BHR1 = lse_BHR.view(batch, num_heads, branch_len, 1)
        self.chunks = _query_chunks(branch_len, min(chunk_size, BACKWARD_QUERY_CHUNK))
        self.q_chunks, self.grad_out_chunks, self.lse_chunks, self.delta_chunks = [], [], [], []
        for start, end in self.chunks:
            self.q_chunks.append(_fold(q_BHRD, num_kv_heads, start, end, dtype) * scale)
            grad_out_KBNV = _fold(grad_out_BHRV, num_kv_heads, start, end, dtype)
            out_KBNV = _fold(out_BHRV, num_kv_heads, start, end, dtype)
            self.grad_out_chunks.append(grad_out_KBNV)
            self.lse_chunks.append(_fold(lse_BHR1, num_kv_heads, start, end, dtype))
            # FlashAttention-2: dS = P * (dP - rowsum(dO * O)) with the GLOBAL softmax (lse).
            self.delta_chunks.append((grad_out_KBNV * out_KBNV).sum(dim=-1, keepdim=True))
        # Accumulates dL/d(scaled scores) @ K; times `scale` at the end gives dq.
        self.grad_q_chunks = [torch.zeros_like(q_KBND) for q_KBND in self.q_chunks]

    def add_prefix(self, k_prefix_TKD, v_prefix_TKD, grad_k_TKD, grad_v_TKD) -> None:
        dtype, chunk_size = self.dtype, self.chunk_size
        prefix_len = k_prefix_TKD.shape[0]
        for key_start in range(0, prefix_len, chunk_size):
            key_end = min(key_start + chunk_size, prefix_len)
            k_KCD = k_prefix_TKD[key_start:key_end].to(dtype).transpose(0, 1)
            v_KCV = v_prefix_TKD[key_start:key_end].to(dtype).transpose(0, 1)
            grad_k_KCD = grad_v_KCV = None
            for i in range(len(self.chunks)):
                # Flattening B into the rows sums the shared prefix's gradient over batch rows
                # and the heads of each kv group inside the bmm.
                q_KMD = self.q_chunks[i].flatten(1, 2)
                grad_out_KMV = self.grad_out_chunks[i].flatten(1, 2)
                probs_KMC = (q_KMD @ k_KCD.transpose(-1, -2)).sub_(self.lse_chunks[i].flatten(1, 2))
                probs_KMC.exp_()
                grad_scores_KMC = (grad_out_KMV @ v_KCV.transpose(-1, -2)).sub_(
                    self.delta_chunks[i].flatten(1, 2)
                )
                grad_scores_KMC.mul_(probs_KMC)
                # view(), not flatten(): it must fail rather than add into a copy.
                self.grad_q_chunks[i].view(q_KMD.shape).baddbmm_(grad_scores_KMC, k_KCD)
                if grad_v_TKD is not None:
                    grad_v_KCV = _add_product(grad_v_KCV, probs_KMC.transpose(-1, -2), grad_out_KMV)
                if grad_k_TKD is not None:
                    grad_k_KCD = _add_product(grad_k_KCD, grad_scores_KMC.transpose(-1, -2), q_KMD)
            if grad_k_KCD is not None:
                grad_k_TKD[key_start:key_end].add_(grad_k_KCD.transpose(0, 1))
            if grad_v_KCV is not None:
                grad_v_TKD[key_start:key_end].add_(grad_v_KCV.transpose(0, 1))

    def reduce(self, ranks: PrefixRanks) -> None:
        ranks.reduce(self.grad_q_chunks)

    def finish(self, k_branch_BKRD: Tensor, v_branch_BKRD: Tensor) -> tuple[Tensor, ...]:
        """(dq, dk_branch, dv_branch) with the branch's causal part added."""
        dtype, chunks = self.dtype, self.chunks
        k_KBRD = _kv_head_major(k_branch_BKRD, dtype)
        v_KBRV = _kv_head_major(v_branch_BKRD, dtype)
        grad_k_KBRD = torch.zeros_like(k_KBRD)
        grad_v_KBRV = torch.zeros_like(v_KBRV)
        for key_start, key_end in chunks:
            k_KBCD = k_KBRD[:, :, key_start:key_end]
            v_KBCV = v_KBRV[:, :, key_start:key_end]
            for i, (start, end) in enumerate(chunks):
                if end <= key_start:
                    continue  # every key of this chunk is in the future of these queries
                q_KBND, grad_out_KBNV = self.q_chunks[i], self.grad_out_chunks[i]
                scores_KBNC = q_KBND @ k_KBCD.transpose(-1, -2)
                if key_end - 1 > start:
                    hidden_NC = _hidden_NC(
                        start, end, key_start, key_end, self.num_groups, q_KBND.device
                    )
                    scores_KBNC.masked_fill_(hidden_NC, float("-inf"))
                probs_KBNC = scores_KBNC.sub_(self.lse_chunks[i]).exp_()
                grad_scores_KBNC = (grad_out_KBNV @ v_KBCV.transpose(-1, -2)).sub_(
                    self.delta_chunks[i]
                )
                grad_scores_KBNC.mul_(probs_KBNC)
                self.grad_q_chunks[i].add_(grad_scores_KBNC @ k_KBCD)
                grad_v_KBRV[:, :, key_start:key_end].add_(
                    probs_KBNC.transpose(-1, -2) @ grad_out_KBNV
                )
                grad_k_KBRD[:, :, key_start:key_end].add_(
                    grad_scores_KBNC.transpose(-1, -2) @ q_KBND
                )
        q_BHRD = self.q_BHRD
        grad_q_BKGRD = torch.cat([_unfold(g, self.num_groups) for g in self.grad_q_chunks], dim=3)
        grad_q_BHRD = (grad_q_BKGRD.reshape(q_BHRD.shape) * self.scale).to(q_BHRD.dtype)
        return (
            grad_q_BHRD,
            grad_k_KBRD.transpose(0, 1).to(k_branch_BKRD.dtype),
            grad_v_KBRV.transpose(0, 1).to(v_branch_BKRD.dtype),
        )


def _backward(
    grad_out_BHRV: Tensor,
    q_BHRD: Tensor,
    out_BHRV: Tensor,
    lse_BHR: Tensor,
    num_kv_heads: int,
    scale: float,
    chunk_size: int,
) -> _FusedBackward | _LoopBackward:
    """The backward of these inputs, to which each prefix's and the branch's part is added:
    the fused CPU kernel for fp32 on CPU, else LongStraw's loop (`longstraw.ops.dispatch`)."""
    kernel = dispatch.ran(
        "full_attention.backward",
        dispatch.attention_backward_kernel(
            q_BHRD.device, out_BHRV.dtype, q_BHRD.shape[-1], out_BHRV.shape[-1]
        ),
    )
    if kernel == dispatch.ATEN_CPU_FLASH:
        return _FusedBackward(grad_out_BHRV, q_BHRD, out_BHRV, lse_BHR, scale, chunk_size)
    return _LoopBackward(grad_out_BHRV, q_BHRD, out_BHRV, lse_BHR, scale, chunk_size, num_kv_heads)


def prefix_backward(
    grad_out_BHRV: Tensor,
    q_BHRD: Tensor,
    out_BHRV: Tensor,
    lse_BHR: Tensor,
    k_TKD,
    v_TKV,
    *,
    scale: float,
    chunk_size: int,
    grad_k_TKD: Tensor | None,
    grad_v_TKV: Tensor | None,
    ranks: PrefixRanks,
) -> None:
    """A serving rank's share of a prompt attention's backward, given the global output and
    log-sum-exp (FlashAttention-2): ADDS dK/dV of its positions into the fp32 buffers and sums
    its share of dq over the ranks (`ranks.reduce`), computed as `prefix_cached_attention`'s
    backward computes the share of the positions its rank holds."""
    backward = _backward(
        grad_out_BHRV, q_BHRD, out_BHRV, lse_BHR, k_TKD.shape[1], scale, chunk_size
    )
    backward.add_prefix(k_TKD, v_TKV, grad_k_TKD, grad_v_TKV)
    backward.reduce(ranks)


class _PrefixCachedAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q_BHRD: Tensor,
        k_branch_BKRD: Tensor,
        v_branch_BKRD: Tensor,
        k_prefix_TKD: Tensor,
        v_prefix_TKD: Tensor,
        scale: float,
        chunk_size: int,
        prefix_grad_k_TKD: Tensor | None,
        prefix_grad_v_TKD: Tensor | None,
        extra_prefix: tuple | None = None,
        outputs: tuple[Tensor, Tensor] | None = None,
        ranks: PrefixRanks | None = None,
    ) -> Tensor:
        prefixes = _prefixes(
            k_prefix_TKD, v_prefix_TKD, prefix_grad_k_TKD, prefix_grad_v_TKD, extra_prefix
        )
        if outputs is None:
            out_BHRV, lse_BKGR = _attention_outputs(
                q_BHRD, k_branch_BKRD, v_branch_BKRD, prefixes, scale, chunk_size, ranks
            )
        else:
            out_BHRV, lse_BKGR = outputs
        # Only branch-sized tensors go through save_for_backward. The prefix (and the gradient
        # buffers) are held as attributes: they are the prompt state and outlive the graph.
        ctx.save_for_backward(q_BHRD, k_branch_BKRD, v_branch_BKRD, out_BHRV, lse_BKGR)
        ctx.prefixes = prefixes
        ctx.prefix_versions = [(k._version, v._version) for k, v, _, _ in prefixes]
        ctx.scale = scale
        ctx.chunk_size = chunk_size
        ctx.ranks = ranks
        return out_BHRV

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out_BHRV: Tensor):
        q_BHRD, k_branch_BKRD, v_branch_BKRD, out_BHRV, lse_BKGR = ctx.saved_tensors
        # save_for_backward would catch this for saved tensors; the prefix is not saved, so
        # check by hand that nobody wrote into the state between forward and backward.
        if [(k._version, v._version) for k, v, _, _ in ctx.prefixes] != ctx.prefix_versions:
            raise RuntimeError(
                "prefix K/V were modified in place between forward and backward of "
                "prefix_cached_attention; the prompt state must stay frozen while a branch graph lives"
            )
        ranks = ctx.ranks
        lse_BHR = lse_BKGR.view(q_BHRD.shape[:3])
        backward = _backward(
            grad_out_BHRV, q_BHRD, out_BHRV, lse_BHR, k_branch_BKRD.shape[1], ctx.scale,
            ctx.chunk_size,
        )  # fmt: skip
        for i, (k_prefix_TKD, v_prefix_TKD, grad_k_TKD, grad_v_TKD) in enumerate(ctx.prefixes):
            # The prompt's share of dq is summed over the ranks that hold it; a branch's earlier
            # segments are the same on every rank, each adds their gradient itself.
            if i == 0 and ranks is not None:
                ranks.cotangent_ready(grad_out_BHRV, out_BHRV, lse_BHR)
            backward.add_prefix(k_prefix_TKD, v_prefix_TKD, grad_k_TKD, grad_v_TKD)
            if i == 0 and ranks is not None:
                backward.reduce(ranks)
        return (
            *backward.finish(k_branch_BKRD, v_branch_BKRD),
            # prefix K/V, scale, chunk size, gradient buffers, extra prefix, outputs, ranks
            *[None] * 9,
        )


def _check_inputs(
    q_BHRD: Tensor,
    k_branch_BKRD: Tensor,
    v_branch_BKRD: Tensor,
    k_prefix_TKD: Tensor,
    v_prefix_TKD: Tensor,
    chunk_size: int,
    prefix_grad_k_TKD: Tensor | None,
    prefix_grad_v_TKD: Tensor | None,
) -> None:
    named = {
        "q_BHRD": q_BHRD,
        "k_branch_BKRD": k_branch_BKRD,
        "v_branch_BKRD": v_branch_BKRD,
        "k_prefix_TKD": k_prefix_TKD,
        "v_prefix_TKD": v_prefix_TKD,
    }
    for name, x in named.items():
        want = 3 if "prefix" in name else 4
        if x.dim() != want:
            raise ValueError(f"{name} must have {want} dims, got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.device != q_BHRD.device:
            raise ValueError(f"{name} is on {x.device} but q_BHRD is on {q_BHRD.device}; move it")
    batch, num_heads, branch_len, head_dim = q_BHRD.shape
    kb, vb = k_branch_BKRD.shape, v_branch_BKRD.shape
    kp, vp = k_prefix_TKD.shape, v_prefix_TKD.shape
    num_kv_heads, value_dim = kb[1], vb[3]
    if branch_len == 0:
        raise ValueError("q_BHRD has branch length R = 0; call with at least one branch token")
    if kb[0] != batch or vb[0] != batch:
        raise ValueError(
            f"batch mismatch: q_BHRD has B={batch}, k_branch_BKRD B={kb[0]}, v_branch_BKRD B={vb[0]}"
        )
    if vb[1] != num_kv_heads or kp[1] != num_kv_heads or vp[1] != num_kv_heads:
        raise ValueError(
            f"kv head mismatch: k_branch_BKRD K={num_kv_heads}, v_branch_BKRD K={vb[1]}, "
            f"k_prefix_TKD K={kp[1]}, v_prefix_TKD K={vp[1]}"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads H={num_heads} must be a multiple of kv heads K={num_kv_heads} (GQA)"
        )
    if kb[2] != branch_len or vb[2] != branch_len:
        raise ValueError(
            f"branch length mismatch: q_BHRD R={branch_len}, k_branch_BKRD R={kb[2]}, "
            f"v_branch_BKRD R={vb[2]}"
        )
    if kb[3] != head_dim or kp[2] != head_dim:
        raise ValueError(
            f"head dim mismatch: q_BHRD D={head_dim}, k_branch_BKRD D={kb[3]}, k_prefix_TKD D={kp[2]}"
        )
    if vp[2] != value_dim:
        raise ValueError(
            f"value head dim mismatch: v_branch_BKRD V={value_dim}, v_prefix_TKD V={vp[2]}"
        )
    if kp[0] != vp[0]:
        raise ValueError(f"prefix length mismatch: k_prefix_TKD T={kp[0]}, v_prefix_TKD T={vp[0]}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if torch.is_grad_enabled() and (k_prefix_TKD.requires_grad or v_prefix_TKD.requires_grad):
        raise ValueError(
            "k_prefix_TKD/v_prefix_TKD require grad, but prefix_cached_attention gives the prefix "
            "no autograd gradient: pass detached prefix tensors and, for the exact gradient, "
            "prefix_grad_k_TKD/prefix_grad_v_TKD buffers"
        )
    for name, buffer, prefix in (
        ("prefix_grad_k_TKD", prefix_grad_k_TKD, k_prefix_TKD),
        ("prefix_grad_v_TKD", prefix_grad_v_TKD, v_prefix_TKD),
    ):
        if buffer is None:
            continue
        if buffer.shape != prefix.shape:
            raise ValueError(
                f"{name} has shape {tuple(buffer.shape)} but the prefix has {tuple(prefix.shape)}"
            )
        if buffer.dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"{name} must be float32 (gradients accumulate in fp32), got {buffer.dtype}"
            )
        if buffer.device != prefix.device:
            raise ValueError(f"{name} is on {buffer.device} but the prefix is on {prefix.device}")
        if buffer.requires_grad:
            raise ValueError(f"{name} must not require grad: it is written in place in backward")


def prefix_cached_attention(
    q_BHRD: Tensor,
    k_branch_BKRD: Tensor,
    v_branch_BKRD: Tensor,
    k_prefix_TKD: Tensor,
    v_prefix_TKD: Tensor,
    *,
    scale: float,
    chunk_size: int = 1024,
    prefix_grad_k_TKD: Tensor | None = None,
    prefix_grad_v_TKD: Tensor | None = None,
    extra_prefix: tuple[Tensor, Tensor, Tensor | None, Tensor | None] | None = None,
    outputs: tuple[Tensor, Tensor] | None = None,
    ranks: PrefixRanks | None = None,
) -> Tensor:
    """Softmax attention of branch queries over [prefix ; branch]; returns out_BHRV in q's dtype.

    Every branch query sees all T prefix positions and branch keys causally (query i sees branch
    keys 0..i); query head h uses kv head h // (H // K). The prefix [T, K, D] has no batch dim
    and is shared by all B rows; T = 0 gives plain causal attention. Work is chunked so that no
    score block exceeds [B, H, chunk_size, chunk_size]; accumulation is fp32 (or wider).

    Gradients flow to q, k_branch and v_branch through autograd. The prefix gets none through
    autograd; if `prefix_grad_k_TKD` / `prefix_grad_v_TKD` (fp32, shaped like the prefix) are
    given, backward ADDS the prefix dK / dV into them in place (summed over batch rows and the
    query heads of each kv group), so repeated branches accumulate the prompt-state cotangent.

    `extra_prefix` = (k [T2, K, D], v [T2, K, V], grad_k, grad_v): a second prefix every query
    also sees whole, between the first and the branch (a long branch's earlier segments on top
    of the prompt); same rules as the first, its gradient added into its own buffers.

    `outputs`: what `prefix_attention_outputs` gave for these same inputs (a checkpointed layer
    recomputed in backward); the forward then keeps them for backward instead of computing them
    again.

    `ranks`: the prefix given is this rank's part of the prompt's (maybe empty), the rest is held
    by the other ranks of `ranks` (see `PrefixRanks`); `extra_prefix` is this rank's own.
    """
    if extra_prefix is not None:
        k2, v2, grad_k2, grad_v2 = extra_prefix
        _check_inputs(q_BHRD, k_branch_BKRD, v_branch_BKRD, k2, v2, chunk_size, grad_k2, grad_v2)
    _check_inputs(
        q_BHRD,
        k_branch_BKRD,
        v_branch_BKRD,
        k_prefix_TKD,
        v_prefix_TKD,
        chunk_size,
        prefix_grad_k_TKD,
        prefix_grad_v_TKD,
    )
    return _PrefixCachedAttention.apply(
        q_BHRD,
        k_branch_BKRD,
        v_branch_BKRD,
        k_prefix_TKD,
        v_prefix_TKD,
        float(scale),
        chunk_size,
        prefix_grad_k_TKD,
        prefix_grad_v_TKD,
        extra_prefix,
        outputs,
        ranks,
    )


@torch.no_grad()
def prefix_attention_outputs(
    q_BHRD: Tensor,
    k_branch_BKRD: Tensor,
    v_branch_BKRD: Tensor,
    k_prefix_TKD: Tensor,
    v_prefix_TKD: Tensor,
    *,
    scale: float,
    chunk_size: int = 1024,
    extra_prefix: tuple[Tensor, Tensor, Tensor | None, Tensor | None] | None = None,
    ranks: PrefixRanks | None = None,
) -> tuple[Tensor, Tensor]:
    """(out_BHRV in q's dtype, lse_BKGR) of `prefix_cached_attention` on the same inputs, without
    autograd: what its forward computes and keeps for backward."""
    prefixes = _prefixes(k_prefix_TKD, v_prefix_TKD, None, None, extra_prefix)
    return _attention_outputs(
        q_BHRD, k_branch_BKRD, v_branch_BKRD, prefixes, float(scale), chunk_size, ranks
    )
