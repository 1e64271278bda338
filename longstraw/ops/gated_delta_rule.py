"""Gated delta rule (Gated DeltaNet's linear attention) with a carried recurrent state.

Drop-in replacements for transformers' `torch_chunk_gated_delta_rule` and
`torch_recurrent_gated_delta_rule` (qwen3_5 / qwen3_next, transformers 5.24): same argument
names, layouts, dtypes and return values, but

- differentiable w.r.t. `initial_state` (plain autograd), so a branch replay started from the
  prompt's final state yields dS, and a loss on the returned final state flows back into
  `initial_state` (exact mode);
- no input is ever written in place (the prompt state is shared by every branch);
- any sequence length T >= 1, so prefill can run shard by shard, each shard starting from the
  previous shard's final state.

The recurrence, per value head, with S the [Dk, Dv] state, scale = Dk ** -0.5:

    S_t   = exp(g_t) * S_{t-1}
    S_t  += k_t ⊗ (beta_t * (v_t - S_t^T k_t))        (the delta rule: write only the error)
    o_t   = S_t^T (scale * q_t)

Legend (transformers' layouts):
    B batch, T tokens, Hk query/key heads, Hv value heads (a multiple of Hk: each key head
    serves Hv // Hk consecutive value heads), Dk key head dim, Dv value head dim,
    N chunks, C chunk size.
    query_BTHD, key_BTHD [B, T, Hk, Dk]; value [B, T, Hv, Dv]; g, beta [B, T, Hv];
    initial_state / final_state [B, Hv, Dk, Dv] (fp32); output [B, T, Hv, Dv] in query's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from longstraw.ops.decay_gate import DecayGate, fp32_log_decays, gate_parts

# transformers' l2norm (aligned with fla): x * rsqrt(sum(x^2) + eps), eps = 1e-6.
_L2NORM_EPS = 1e-6
# Decays and UT-transform entries below NEGLIGIBLE are zero. Log-decays near -30 per token
# (Gated DeltaNet's random initialisation, and some trained heads) make a chunk's decays and the
# products built on them reach float64's subnormals (below 2^-1022), and x86 takes a microcode
# assist on every operation that touches one: one 256-token block of the float64 delta-rule
# backward (replay and vector-Jacobian product, `small` hybrid) took 47 ms with them and 31 ms
# without on one thread, 28 and 17 ms on two. Flushing subnormals in the CPU
# (`torch.set_flush_denormal`) reaches only the calling thread, not OpenMP's workers; zeroing
# at the source reaches every thread. Products of two kept values stay above 2^-1000, normal;
# what still turns subnormal inside the triangular solve is zeroed after it. Every term dropped
# is below 2^-500 of the O(1) terms it is summed with, 2^-447 under float64's resolution, and
# the kernels' results leave rounded to fp32 (2^-149 at the smallest): no result a test or a
# user can see changes, and where no decay is that small nothing is zeroed. In fp32 every value
# this small is already zero.
NEGLIGIBLE = 2.0**-500
_LOG_NEGLIGIBLE = math.log(NEGLIGIBLE)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2NORM_EPS)


def _negligible_zeroed(x: torch.Tensor) -> torch.Tensor:
    """`x` with every entry below `NEGLIGIBLE` in magnitude set to zero (a new tensor;
    differentiable, zero gradient where zeroed). fp32 has no nonzero value that small: an fp32
    tensor comes back unchanged."""
    return torch.where(x.abs() < NEGLIGIBLE, 0.0, x)


def _check_inputs(query, key, value, g, beta, initial_state, kwargs) -> None:
    if kwargs.get("cu_seqlens") is not None:
        raise ValueError(
            "packed sequences (cu_seqlens) are not supported by LongStraw's gated delta rule; "
            "run one sequence per batch row instead"
        )
    if query.ndim != 4 or query.shape != key.shape:
        raise ValueError(
            f"query and key must both be [B, T, Hk, Dk]; got {tuple(query.shape)} and {tuple(key.shape)}"
        )
    B, T, Hk, Dk = key.shape
    if value.ndim != 4 or value.shape[:2] != (B, T) or value.shape[2] % Hk != 0:
        raise ValueError(
            f"value must be [B, T, Hv, Dv] with Hv a multiple of Hk={Hk}; got {tuple(value.shape)}"
        )
    Hv, Dv = value.shape[2:]
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, Hv):
            raise ValueError(f"{name} must be [B, T, Hv] = {(B, T, Hv)}; got {tuple(t.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (B, Hv, Dk, Dv):
        raise ValueError(
            f"initial_state must be [B, Hv, Dk, Dv] = {(B, Hv, Dk, Dv)}; got {tuple(initial_state.shape)}"
        )


def _to_heads_first_fp32(query, key, value, g, beta, use_qk_l2norm_in_kernel):
    """[B, T, H, D] -> [B, Hv, T, D] fp32 (keys/queries repeated for grouped value heads),
    l2-normalised if asked, queries scaled by Dk ** -0.5 — exactly transformers' preamble."""
    return _to_heads_first(query, key, value, g, beta, use_qk_l2norm_in_kernel, torch.float32)


def _to_heads_first(query, key, value, g, beta, use_qk_l2norm_in_kernel, dtype):
    Hk, Hv = key.shape[2], value.shape[2]
    if Hk != Hv:
        query = query.repeat_interleave(Hv // Hk, dim=2)
        key = key.repeat_interleave(Hv // Hk, dim=2)
    q, k, v, beta, g = (
        x.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, g)
    )
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g, beta


def _segment_decays(g_XC: torch.Tensor) -> torch.Tensor:
    """[..., C] log-decays of one chunk -> [..., C, C + 1] decays of every segment in it:
    [i, c] = exp(g_c + ... + g_i) for c <= i (0 where that is below `NEGLIGIBLE`), 1 for
    c = i + 1 (the empty segment), 0 above.

    Each entry is its own segment's sum: a cumsum from every start c, not the difference
    gcum_i - gcum_j of one cumsum (transformers' kernel). That difference is what lost the decay
    gradients: the diagonal decay exp(gcum_i - gcum_i) is 1 whatever g is, yet its (large)
    cotangent reaches gcum_i once with + and once with -, and dg_t then comes out of a reverse
    cumsum over every later token, in which all segments not containing t cancel — a small
    difference of large sums. Here the empty segment is a constant and autograd reaches g_t only
    through segments that contain t. Measured against float64 autograd of the recurrence
    (T = 300, g = -exp(A_log) * softplus(a + 1), A_log uniform in [2.5, 4]), relative error of
    the A_log gradient: 6.4e-3 with gcum differences, 4.8e-5 with only the diagonal made
    constant, 3.1e-7 here, 2.3e-7 for the per-token recurrence in fp32.
    """
    C = g_XC.shape[-1]
    before_start_CC = torch.ones(C, C, dtype=torch.bool, device=g_XC.device).tril(-1)
    # [c, i] = g_c + ... + g_i for i >= c (0 for i < c), transposed to [i, c].
    seg_XIC = g_XC.unsqueeze(-2).masked_fill(before_start_CC, 0.0).cumsum(dim=-1).transpose(-1, -2)
    seg_XIS = torch.cat([seg_XIC, torch.zeros_like(g_XC).unsqueeze(-1)], dim=-1)
    beyond_CS = torch.ones(C, C + 1, dtype=torch.bool, device=g_XC.device).triu(2)
    negligible = seg_XIS < _LOG_NEGLIGIBLE
    return seg_XIS.masked_fill(beyond_CS | negligible, float("-inf")).exp()


class _ChunkedWithFloat64Backward(torch.autograd.Function):
    """`_chunked` in fp32 forward; the backward recomputes it in float64 and backpropagates there.

    The decay gradients are what needs it: dA_log = sum_t g_t dg_t, and with weak decay that sum
    cancels 100-1000-fold, while in the chunked form every dg_t is itself a sum over the chunk's
    segments whose terms (the UT transform's, the intra-chunk attention's, the state's) cancel
    again. No single fp32 stage is to blame: with any one stage of an otherwise float64 kernel
    in fp32 (forward and backward), dA_log was 4e-5 to 3e-4 off on a 62-token chunk with
    A = 0.001, the whole kernel in fp32 3.5e-4, the per-token recurrence in fp32 2.0e-5, the
    kernel in float64 4.6e-6 (what the fp32 gates and gradients at its interface leave; given
    a `DecayGate`, the backward forms the gates in float64 too and that is gone).
    The forward is `_chunked` in fp32 exactly (its bits, none of its graph kept: only the inputs
    are saved); the gradients are returned in the inputs' dtypes. The log-decays come in as
    `formula(*gate_tensors)` (`longstraw.ops.decay_gate.gate_parts`).
    """

    @staticmethod
    def forward(ctx, chunk_size, use_l2norm, formula, query, key, value, beta, state, *gate):
        ctx.chunk_size, ctx.use_l2norm, ctx.formula = chunk_size, use_l2norm, formula
        ctx.save_for_backward(query, key, value, beta, state, *gate)
        with torch.no_grad():
            g = formula(*(x.float() for x in gate))
            return _chunked(
                query, key, value, g, beta, chunk_size, state, use_l2norm, torch.float32
            )

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_state):
        inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        leaves = [
            x.detach().double().requires_grad_(need) for x, need in zip(inputs, needs, strict=True)
        ]
        q, k, v, beta, state = leaves[:5]
        with torch.enable_grad():
            out, final = chunked_in_float64(
                q,
                k,
                v,
                ctx.formula(*leaves[5:]),
                beta,
                initial_state=state,
                chunk_size=ctx.chunk_size,
                use_qk_l2norm_in_kernel=ctx.use_l2norm,
            )
        wanted = [i for i, need in enumerate(needs) if need]
        grads = torch.autograd.grad(
            (out, final),
            [leaves[i] for i in wanted],
            (d_out.double(), d_state.double()),
            allow_unused=True,
        )
        result: list[torch.Tensor | None] = [None] * len(inputs)
        for i, grad in zip(wanted, grads, strict=True):
            result[i] = None if grad is None else grad.to(inputs[i].dtype)
        return (None, None, None, *result)


def chunked_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor | DecayGate,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over chunks of `chunk_size` tokens (the WY/UT form), from `initial_state`.

    Same signature, layouts and results as transformers' `torch_chunk_gated_delta_rule`
    (see the module legend); extra keyword arguments (e.g. `cu_seqlens=None`) are accepted and
    ignored, except a non-None `cu_seqlens`, which is refused. Returns
    (output [B, T, Hv, Dv] in query's dtype, final_state [B, Hv, Dk, Dv] fp32 or None).

    Differences from transformers', which do not change the math: every decay is exp of its own
    within-chunk segment sum, not of a difference of one cumsum (`_segment_decays`: the gradient
    of the decays, A_log and dt_bias, keeps fp32 accuracy); a sequence shorter than one
    chunk is one chunk of its own length (no padding to 64 for a 1-token step); the UT
    system's inverse is formed once and applied by matmuls instead of two triangular solves;
    the inter-chunk reads `q @ S` and the intra-chunk attention run batched after the scan
    instead of inside it; nothing is assigned into a slice, so autograd sees plain ops. Agrees
    with transformers' to fp32 rounding (measured ≤ 5.7e-7 abs on unit-scale outputs).

    With grad, the forward keeps only its inputs and the backward recomputes the chunks in
    float64 and backpropagates there (`_ChunkedWithFloat64Backward`: the decay gradients cancel
    too much for an fp32 backward); the gradients come back in the inputs' dtypes. `g` may be
    the `DecayGate` that forms the log-decays: the same forward, and the backward differentiates
    their formation in float64 too (`longstraw.ops.decay_gate`).
    """
    _check_inputs(query, key, value, g, beta, initial_state, kwargs)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    formula, gate = gate_parts(g)
    inputs = (query, key, value, beta, initial_state, *gate)
    if not torch.is_grad_enabled() or not any(x is not None and x.requires_grad for x in inputs):
        out, state = _chunked(
            query,
            key,
            value,
            fp32_log_decays(g),
            beta,
            chunk_size,
            initial_state,
            use_qk_l2norm_in_kernel,
            torch.float32,
        )
        return out, (state if output_final_state else None)
    if initial_state is None:
        B, _, _, Dk = key.shape
        Hv, Dv = value.shape[2:]
        initial_state = torch.zeros(B, Hv, Dk, Dv, dtype=torch.float32, device=value.device)
    out, state = _ChunkedWithFloat64Backward.apply(
        chunk_size, use_qk_l2norm_in_kernel, formula, query, key, value, beta, initial_state, *gate
    )
    return out, (state if output_final_state else None)


def chunked_in_float64(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_gated_delta_rule`'s computation with every operation in float64, differentiable
    by plain autograd (so its backward is float64 too) ->
    (output [B, T, Hv, Dv] float64, final state [B, Hv, Dk, Dv] float64).

    For the backwards that must not round to fp32 inside: the chunked kernel's own and the
    blockwise backward's recomputation (`longstraw.ops.blockwise_backward`).
    """
    _check_inputs(query, key, value, g, beta, initial_state, {})
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    return _chunked(
        query.double(),
        key.double(),
        value.double(),
        g.double(),
        beta.double(),
        chunk_size,
        initial_state.double(),
        use_qk_l2norm_in_kernel,
        torch.float64,
    )


def _ut_transform(k_XCK, v_XCV, beta_XC1, decay_XCC, from_start_XC):
    """The UT transform of chunks [..., C, .] given their within-chunk decays and the decays
    from the chunk start (views of `_segment_decays`): with M = I + strict_lower(diag(beta) K K^T ⊙ decay) (unit lower triangular),
    -> ((beta k) k^T, M^-1, u = M^-1 beta v, w = M^-1 (beta k ⊙ decay from the chunk start)).

    M^-1 is formed once by a triangular solve and applied by matmuls: on CPU a batched bmm
    beats a batched triangular solve per right-hand side by 2-3x, forward and backward (C=64,
    D=128: 0.05 s vs 0.10-0.15 s at T=4096, Hv=4). Negligible entries of M^-1 and w are zeroed
    (`_negligible_zeroed`)."""
    C = k_XCK.shape[-2]
    kb_XCK = k_XCK * beta_XC1
    kk_XCC = kb_XCK @ k_XCK.transpose(-1, -2)
    ut_XCC = kk_XCC * decay_XCC
    eye_CC = torch.eye(C, dtype=k_XCK.dtype, device=k_XCK.device)
    inv_XCC = _negligible_zeroed(
        torch.linalg.solve_triangular(
            ut_XCC, eye_CC.expand_as(ut_XCC), upper=False, unitriangular=True
        )
    )
    u_XCV = inv_XCC @ (v_XCV * beta_XC1)
    w_XCK = _negligible_zeroed(inv_XCC @ (kb_XCK * from_start_XC.unsqueeze(-1)))
    return kk_XCC, inv_XCC, u_XCV, w_XCK


def _chunk_scan(k_BHNCK, u_BHNCV, w_BHNCK, from_start_BHNC, to_end_BHNC, state_BHKV):
    """The sequential scan over the N chunks (dim 2), only what needs the running state, given
    the decays from each chunk's start and to its end (views of `_segment_decays`) ->
    (the state entering each chunk [B, H, N, K, V], the new values vn = u - w S [B, H, N, C, V],
    the final state). The per-chunk pieces are taken by one unbind each: under autograd its
    backward is one stack, where indexing chunk i would zero-fill and write a whole
    [B, H, N, ...] gradient per chunk."""
    # Keys weighted by the decay from each token to the chunk end, for the state update.
    k_to_end_BHNCK = k_BHNCK * to_end_BHNC.unsqueeze(-1)
    chunk_decay_BHN11 = from_start_BHNC[..., -1, None, None]
    u_chunks, w_chunks = u_BHNCV.unbind(2), w_BHNCK.unbind(2)
    decay_chunks, k_to_end_chunks = chunk_decay_BHN11.unbind(2), k_to_end_BHNCK.unbind(2)
    starts, v_new = [], []
    for i in range(k_BHNCK.shape[2]):
        starts.append(state_BHKV)
        v_new_i = u_chunks[i] - w_chunks[i] @ state_BHKV
        v_new.append(v_new_i)
        state_BHKV = state_BHKV * decay_chunks[i] + k_to_end_chunks[i].transpose(-1, -2) @ v_new_i
    return torch.stack(starts, dim=2), torch.stack(v_new, dim=2), state_BHKV


def _chunked(query, key, value, g, beta, chunk_size, initial_state, use_qk_l2norm_in_kernel, dtype):
    """`chunked_gated_delta_rule`'s computation, in `dtype` (float32 for the kernel) ->
    (output [B, T, Hv, Dv] in query's dtype, final state [B, Hv, Dk, Dv] in `dtype`)."""
    out_dtype = query.dtype
    B, T, _, Dk = key.shape
    Hv, Dv = value.shape[2:]
    q, k, v, g, beta = _to_heads_first(query, key, value, g, beta, use_qk_l2norm_in_kernel, dtype)

    if initial_state is None:
        state = torch.zeros(B, Hv, Dk, Dv, dtype=dtype, device=v.device)
    else:
        state = initial_state.to(device=v.device, dtype=dtype)
    if T == 0:
        return value.new_zeros(B, 0, Hv, Dv).to(out_dtype), state

    C = min(chunk_size, T)
    # Padded tokens have k = v = beta = 0 and g = 0 (decay 1): they leave the state untouched.
    pad = (C - T % C) % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    N = (T + pad) // C
    q_BHNCK, k_BHNCK = q.view(B, Hv, N, C, Dk), k.view(B, Hv, N, C, Dk)
    v_BHNCV = v.view(B, Hv, N, C, Dv)
    beta_BHNC1 = beta.view(B, Hv, N, C, 1)

    # Every decay the chunk uses is exp of a within-chunk segment sum (`_segment_decays`):
    # pairwise, from the chunk start to each token, from each token to the chunk end.
    seg_BHNCS = _segment_decays(g.view(B, Hv, N, C))
    decay_BHNCC = seg_BHNCS[..., 1:]  # decay_ij = exp(g_{j+1} + ... + g_i), j <= i; 0 above
    from_start_BHNC = seg_BHNCS[..., 0]  # exp(g_0 + ... + g_i)
    to_end_BHNC = seg_BHNCS[..., -1, 1:]  # exp(g_{j+1} + ... + g_{C-1})
    _, _, u_BHNCV, w_BHNCK = _ut_transform(
        k_BHNCK, v_BHNCV, beta_BHNC1, decay_BHNCC, from_start_BHNC
    )
    starts_BHNKV, v_new_BHNCV, state = _chunk_scan(
        k_BHNCK, u_BHNCV, w_BHNCK, from_start_BHNC, to_end_BHNC, state
    )

    # Output = read of the entering state (decayed to each token) + intra-chunk attention.
    attn_BHNCC = (q_BHNCK @ k_BHNCK.transpose(-1, -2)) * decay_BHNCC
    q_decayed_BHNCK = q_BHNCK * from_start_BHNC.unsqueeze(-1)
    out_BHNCV = q_decayed_BHNCK @ starts_BHNKV + attn_BHNCC @ v_new_BHNCV
    out = out_BHNCV.reshape(B, Hv, N * C, Dv)[:, :, :T]
    out = out.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format)
    return out, state


def naive_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference: the per-token recurrence, as transformers' `torch_recurrent_gated_delta_rule`.

    Same signature as `chunked_gated_delta_rule` (`chunk_size` is accepted and ignored) and the
    same results up to fp32 reordering. Slow: one small step per token.
    """
    del chunk_size
    _check_inputs(query, key, value, g, beta, initial_state, kwargs)
    out_dtype = query.dtype
    B, T, _, Dk = key.shape
    Hv, Dv = value.shape[2:]
    q, k, v, g, beta = _to_heads_first_fp32(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    if initial_state is None:
        state_BHKV = torch.zeros(B, Hv, Dk, Dv, dtype=torch.float32, device=v.device)
    else:
        state_BHKV = initial_state.to(device=v.device, dtype=torch.float32)
    outs = []
    for t in range(T):
        q_t, k_t, v_t = q[:, :, t], k[:, :, t], v[:, :, t]
        state_BHKV = state_BHKV * g[:, :, t].exp()[..., None, None]
        kv_mem_BHV = (state_BHKV * k_t.unsqueeze(-1)).sum(dim=-2)
        delta_BHV = (v_t - kv_mem_BHV) * beta[:, :, t].unsqueeze(-1)
        state_BHKV = state_BHKV + k_t.unsqueeze(-1) * delta_BHV.unsqueeze(-2)
        outs.append((state_BHKV * q_t.unsqueeze(-1)).sum(dim=-2))
    out = torch.stack(outs, dim=1) if T else value.new_zeros(B, 0, Hv, Dv, dtype=torch.float32)
    out = out.to(out_dtype, memory_format=torch.contiguous_format)
    return out, (state_BHKV if output_final_state else None)
