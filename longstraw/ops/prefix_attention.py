"""Prefix-cached attention: branch queries over [frozen prefix ; causal branch], never copying the prefix.

Shape legend:
    B batch rows (samples of one prompt), H query heads, K kv heads (H % K == 0),
    G = H // K query heads per kv head, R branch length (or prefill shard length),
    T prefix length (may be 0), D query/key head dim, V value head dim (may differ from D),
    Q rows of one query chunk with the G heads of a kv group folded in (G * chunk rows),
    C keys of one key chunk.
    Value tensors keep the `_BKRD`/`_TKD` suffix of the public API; their last dim is V.

The prefix K/V are the prompt state ([T, K, D], no batch dim, shared by all B rows). They are
read chunk by chunk, never concatenated, copied whole or saved for backward: autograd keeps
them as ctx attributes (they live anyway as the state) and backward re-reads them. In exact
mode the prefix gradient is *added* into caller-owned fp32 buffers, so accumulating the prompt
cotangent over many branches allocates nothing prefix-sized.

The pure-torch path below is used on every device; flash_attn is not used because its backward
cannot add the prefix dK/dV into an external buffer without materialising a prefix-sized tensor.
"""

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


def merge_partial_attention(
    out_a_BHRV: Tensor, lse_a_BHR: Tensor, out_b_BHRV: Tensor, lse_b_BHR: Tensor
) -> tuple[Tensor, Tensor]:
    """Merge two softmax attentions over disjoint key sets by log-sum-exp; returns (out, lse).

    Each partial is normalised over its own keys; lse = -inf marks a partial with no keys (its
    out is ignored). At least one side must have keys for every row. Works for any leading
    shape; compute in fp32 or wider.
    """
    lse_BHR = torch.logaddexp(lse_a_BHR, lse_b_BHR)
    weight_a_BHR1 = torch.exp(lse_a_BHR - lse_BHR)[..., None]
    weight_b_BHR1 = torch.exp(lse_b_BHR - lse_BHR)[..., None]
    # where(): an empty partial may carry NaN/garbage in out, and 0 * NaN is NaN.
    out_BHRV = torch.where(weight_a_BHR1 > 0, weight_a_BHR1 * out_a_BHRV, 0.0) + torch.where(
        weight_b_BHR1 > 0, weight_b_BHR1 * out_b_BHRV, 0.0
    )
    return out_BHRV, lse_BHR


# --------------------------------------------------------------------------------------------
# Chunked forward pieces. Queries arrive as one chunk [B, K, Q, D] (G heads folded into rows)
# in the compute dtype; the running online-softmax state is (row max, row sum, unnormalised out).


def _online_softmax_step(
    max_BKQ: Tensor, sum_BKQ: Tensor, acc_BKQV: Tensor, scores_BKQC: Tensor, v_xKCV: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    new_max_BKQ = torch.maximum(max_BKQ, scores_BKQC.amax(dim=-1))
    rescale_BKQ = torch.exp(max_BKQ - new_max_BKQ)
    probs_BKQC = torch.exp(scores_BKQC - new_max_BKQ[..., None])
    new_sum_BKQ = sum_BKQ * rescale_BKQ + probs_BKQC.sum(dim=-1)
    new_acc_BKQV = acc_BKQV * rescale_BKQ[..., None] + probs_BKQC @ v_xKCV
    return new_max_BKQ, new_sum_BKQ, new_acc_BKQV


def _finish(max_BKQ: Tensor, sum_BKQ: Tensor, acc_BKQV: Tensor) -> tuple[Tensor, Tensor]:
    return acc_BKQV / sum_BKQ[..., None], max_BKQ + torch.log(sum_BKQ)


def _prefix_partial(
    q_BKQD: Tensor, k_prefix_TKD: Tensor, v_prefix_TKD: Tensor, scale: float, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Attention of one query chunk over all prefix keys; requires T > 0."""
    batch, num_kv_heads, rows, _ = q_BKQD.shape
    dtype = q_BKQD.dtype
    max_BKQ = q_BKQD.new_full((batch, num_kv_heads, rows), float("-inf"))
    sum_BKQ = q_BKQD.new_zeros((batch, num_kv_heads, rows))
    acc_BKQV = q_BKQD.new_zeros((batch, num_kv_heads, rows, v_prefix_TKD.shape[-1]))
    for start in range(0, k_prefix_TKD.shape[0], chunk_size):
        # .to() copies one chunk at most (none when the state is already in the compute dtype).
        k_KDC = k_prefix_TKD[start : start + chunk_size].to(dtype).permute(1, 2, 0)
        v_KCV = v_prefix_TKD[start : start + chunk_size].to(dtype).permute(1, 0, 2)
        scores_BKQC = (q_BKQD @ k_KDC) * scale
        max_BKQ, sum_BKQ, acc_BKQV = _online_softmax_step(
            max_BKQ, sum_BKQ, acc_BKQV, scores_BKQC, v_KCV
        )
    return _finish(max_BKQ, sum_BKQ, acc_BKQV)


def _causal_mask_QC(
    query_start: int, query_end: int, key_start: int, key_end: int, num_groups: int, device
) -> Tensor:
    """True where a (group-folded) query row may NOT see a key: key position > query position."""
    query_pos_Q = torch.arange(query_start, query_end, device=device).repeat(num_groups)
    key_pos_C = torch.arange(key_start, key_end, device=device)
    return key_pos_C[None, :] > query_pos_Q[:, None]


def _branch_partial(
    q_BKQD: Tensor,
    k_branch_BKRD: Tensor,
    v_branch_BKRD: Tensor,
    query_start: int,
    query_end: int,
    scale: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """Causal attention of branch queries [query_start, query_end) over branch keys 0..query."""
    batch, num_kv_heads, rows, _ = q_BKQD.shape
    num_groups = rows // (query_end - query_start)
    dtype = q_BKQD.dtype
    max_BKQ = q_BKQD.new_full((batch, num_kv_heads, rows), float("-inf"))
    sum_BKQ = q_BKQD.new_zeros((batch, num_kv_heads, rows))
    acc_BKQV = q_BKQD.new_zeros((batch, num_kv_heads, rows, v_branch_BKRD.shape[-1]))
    # Key 0 is in the first chunk and visible to every query, so no row's max stays -inf.
    for key_start in range(0, query_end, chunk_size):
        key_end = min(key_start + chunk_size, k_branch_BKRD.shape[2])
        k_BKCD = k_branch_BKRD[:, :, key_start:key_end].to(dtype)
        v_BKCV = v_branch_BKRD[:, :, key_start:key_end].to(dtype)
        scores_BKQC = (q_BKQD @ k_BKCD.transpose(-1, -2)) * scale
        if key_end - 1 > query_start:
            hidden_QC = _causal_mask_QC(
                query_start, query_end, key_start, key_end, num_groups, q_BKQD.device
            )
            scores_BKQC = scores_BKQC.masked_fill(hidden_QC, float("-inf"))
        max_BKQ, sum_BKQ, acc_BKQV = _online_softmax_step(
            max_BKQ, sum_BKQ, acc_BKQV, scores_BKQC, v_BKCV
        )
    return _finish(max_BKQ, sum_BKQ, acc_BKQV)


def _query_chunks(branch_len: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_size, branch_len)) for s in range(0, branch_len, chunk_size)]


def _fold(x_BKGRX: Tensor, start: int, end: int) -> Tensor:
    """Rows [start, end) of every head of a kv group as one [B, K, G * rows, X] block."""
    batch, num_kv_heads, num_groups, _, dim = x_BKGRX.shape
    return x_BKGRX[:, :, :, start:end].reshape(batch, num_kv_heads, num_groups * (end - start), dim)


def _unfold(x_BKQX: Tensor, num_groups: int) -> Tensor:
    batch, num_kv_heads, rows, dim = x_BKQX.shape
    return x_BKQX.view(batch, num_kv_heads, num_groups, rows // num_groups, dim)


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
    ) -> Tensor:
        batch, num_heads, branch_len, _ = q_BHRD.shape
        num_kv_heads = k_branch_BKRD.shape[1]
        num_groups = num_heads // num_kv_heads
        value_dim = v_branch_BKRD.shape[-1]
        prefix_len = k_prefix_TKD.shape[0]
        # Accumulate in fp32 for bf16/fp16 inputs; fp64 stays fp64 (lets gradcheck run).
        dtype = torch.promote_types(q_BHRD.dtype, torch.float32)

        q_BKGRD = q_BHRD.view(batch, num_kv_heads, num_groups, branch_len, -1)
        out_BKGRV = q_BHRD.new_empty(
            (batch, num_kv_heads, num_groups, branch_len, value_dim), dtype=dtype
        )
        lse_BKGR = q_BHRD.new_empty((batch, num_kv_heads, num_groups, branch_len), dtype=dtype)
        for start, end in _query_chunks(branch_len, chunk_size):
            q_BKQD = _fold(q_BKGRD, start, end).to(dtype)
            out_BKQV, lse_BKQ = _branch_partial(
                q_BKQD, k_branch_BKRD, v_branch_BKRD, start, end, scale, chunk_size
            )
            if prefix_len > 0:
                out_p_BKQV, lse_p_BKQ = _prefix_partial(
                    q_BKQD, k_prefix_TKD, v_prefix_TKD, scale, chunk_size
                )
                out_BKQV, lse_BKQ = merge_partial_attention(
                    out_p_BKQV, lse_p_BKQ, out_BKQV, lse_BKQ
                )
            out_BKGRV[:, :, :, start:end] = _unfold(out_BKQV, num_groups)
            lse_BKGR[:, :, :, start:end] = _unfold(lse_BKQ[..., None], num_groups)[..., 0]

        out_BHRV = out_BKGRV.view(batch, num_heads, branch_len, value_dim).to(q_BHRD.dtype)
        # Only branch-sized tensors go through save_for_backward. The prefix (and the gradient
        # buffers) are held as attributes: they are the prompt state and outlive the graph.
        ctx.save_for_backward(q_BHRD, k_branch_BKRD, v_branch_BKRD, out_BHRV, lse_BKGR)
        ctx.k_prefix_TKD = k_prefix_TKD
        ctx.v_prefix_TKD = v_prefix_TKD
        ctx.prefix_versions = (k_prefix_TKD._version, v_prefix_TKD._version)
        ctx.prefix_grad_k_TKD = prefix_grad_k_TKD
        ctx.prefix_grad_v_TKD = prefix_grad_v_TKD
        ctx.scale = scale
        ctx.chunk_size = chunk_size
        return out_BHRV

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out_BHRV: Tensor):
        q_BHRD, k_branch_BKRD, v_branch_BKRD, out_BHRV, lse_BKGR = ctx.saved_tensors
        k_prefix_TKD, v_prefix_TKD = ctx.k_prefix_TKD, ctx.v_prefix_TKD
        # save_for_backward would catch this for saved tensors; the prefix is not saved, so
        # check by hand that nobody wrote into the state between forward and backward.
        if (k_prefix_TKD._version, v_prefix_TKD._version) != ctx.prefix_versions:
            raise RuntimeError(
                "prefix K/V were modified in place between forward and backward of "
                "prefix_cached_attention; the prompt state must stay frozen while a branch graph lives"
            )
        grad_k_TKD, grad_v_TKD = ctx.prefix_grad_k_TKD, ctx.prefix_grad_v_TKD
        scale, chunk_size = ctx.scale, ctx.chunk_size
        batch, num_heads, branch_len, _ = q_BHRD.shape
        num_kv_heads = k_branch_BKRD.shape[1]
        num_groups = num_heads // num_kv_heads
        value_dim = v_branch_BKRD.shape[-1]
        prefix_len = k_prefix_TKD.shape[0]
        dtype = lse_BKGR.dtype

        def grouped(x_BHRX: Tensor) -> Tensor:
            return x_BHRX.view(batch, num_kv_heads, num_groups, branch_len, -1)

        # Per query chunk, in the folded [B, K, Q, X] layout every block product uses.
        chunks = _query_chunks(branch_len, chunk_size)
        q_chunks, grad_out_chunks, lse_chunks, delta_chunks = [], [], [], []
        for start, end in chunks:
            q_chunks.append(_fold(grouped(q_BHRD), start, end).to(dtype))
            grad_out_BKQV = _fold(grouped(grad_out_BHRV), start, end).to(dtype)
            out_BKQV = _fold(grouped(out_BHRV), start, end).to(dtype)
            grad_out_chunks.append(grad_out_BKQV)
            lse_chunks.append(_fold(lse_BKGR[..., None], start, end)[..., 0])
            # FlashAttention-2: dS = P * (dP - rowsum(dO * O)) with the GLOBAL softmax.
            delta_chunks.append((grad_out_BKQV * out_BKQV).sum(dim=-1))
        grad_q_chunks = [torch.zeros_like(q_BKQD) for q_BKQD in q_chunks]

        for key_start in range(0, prefix_len, chunk_size):
            key_end = min(key_start + chunk_size, prefix_len)
            k_KCD = k_prefix_TKD[key_start:key_end].to(dtype).transpose(0, 1)
            v_KCV = v_prefix_TKD[key_start:key_end].to(dtype).transpose(0, 1)
            grad_k_KCD = torch.zeros_like(k_KCD) if grad_k_TKD is not None else None
            grad_v_KCV = torch.zeros_like(v_KCV) if grad_v_TKD is not None else None
            for i in range(len(chunks)):
                q_BKQD, grad_out_BKQV = q_chunks[i], grad_out_chunks[i]
                probs_BKQC = torch.exp(
                    (q_BKQD @ k_KCD.transpose(-1, -2)) * scale - lse_chunks[i][..., None]
                )
                grad_scores_BKQC = probs_BKQC * (
                    grad_out_BKQV @ v_KCV.transpose(-1, -2) - delta_chunks[i][..., None]
                )
                grad_q_chunks[i] += (grad_scores_BKQC @ k_KCD) * scale
                # The prefix is shared by all rows and all heads of a group: sum over both.
                if grad_v_KCV is not None:
                    grad_v_KCV += torch.einsum("bkqc,bkqv->kcv", probs_BKQC, grad_out_BKQV)
                if grad_k_KCD is not None:
                    grad_k_KCD += torch.einsum("bkqc,bkqd->kcd", grad_scores_BKQC, q_BKQD) * scale
            if grad_k_KCD is not None:
                grad_k_TKD[key_start:key_end].add_(grad_k_KCD.transpose(0, 1))
            if grad_v_KCV is not None:
                grad_v_TKD[key_start:key_end].add_(grad_v_KCV.transpose(0, 1))

        grad_k_branch_BKRD = torch.zeros(k_branch_BKRD.shape, dtype=dtype, device=q_BHRD.device)
        grad_v_branch_BKRD = torch.zeros(v_branch_BKRD.shape, dtype=dtype, device=q_BHRD.device)
        for key_start, key_end in chunks:
            k_BKCD = k_branch_BKRD[:, :, key_start:key_end].to(dtype)
            v_BKCV = v_branch_BKRD[:, :, key_start:key_end].to(dtype)
            for i, (start, end) in enumerate(chunks):
                if end <= key_start:
                    continue  # every key of this chunk is in the future of these queries
                q_BKQD, grad_out_BKQV = q_chunks[i], grad_out_chunks[i]
                scores_BKQC = (q_BKQD @ k_BKCD.transpose(-1, -2)) * scale
                if key_end - 1 > start:
                    hidden_QC = _causal_mask_QC(
                        start, end, key_start, key_end, num_groups, q_BHRD.device
                    )
                    scores_BKQC = scores_BKQC.masked_fill(hidden_QC, float("-inf"))
                probs_BKQC = torch.exp(scores_BKQC - lse_chunks[i][..., None])
                grad_scores_BKQC = probs_BKQC * (
                    grad_out_BKQV @ v_BKCV.transpose(-1, -2) - delta_chunks[i][..., None]
                )
                grad_q_chunks[i] += (grad_scores_BKQC @ k_BKCD) * scale
                grad_v_branch_BKRD[:, :, key_start:key_end] += (
                    probs_BKQC.transpose(-1, -2) @ grad_out_BKQV
                )
                grad_k_branch_BKRD[:, :, key_start:key_end] += (
                    grad_scores_BKQC.transpose(-1, -2) @ q_BKQD
                ) * scale

        grad_q_BKGRD = torch.cat([_unfold(g, num_groups) for g in grad_q_chunks], dim=3)
        grad_q_BHRD = grad_q_BKGRD.reshape(q_BHRD.shape).to(q_BHRD.dtype)
        assert grad_v_branch_BKRD.shape[-1] == value_dim
        return (
            grad_q_BHRD,
            grad_k_branch_BKRD.to(k_branch_BKRD.dtype),
            grad_v_branch_BKRD.to(v_branch_BKRD.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
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
    """
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
    )
