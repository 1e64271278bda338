"""Autograd functions that save only their inputs and recompute in blocks of tokens in backward.

The exact sweep recomputes a whole prefill shard (thousands of tokens) with autograd. With plain
autograd, the token-wise MLP of one layer keeps [T, intermediate] activations and the chunked
Gated DeltaNet keeps a dozen per-chunk tensors for all T tokens, until the layer's backward is
done; that graph, not the prompt state, set exact mode's extra memory. The functions here keep
the forward exactly as it was — the same function, on the same whole input, under no_grad, so the
sweep's recomputed state stays bitwise the prefill's — and move the graph into the backward, where
it is built and freed one block of tokens at a time:

- `rows_recomputed_in_blocks(fn, x, params)`: for a function applied to every token on its own
  (an MLP, dense or mixture-of-experts with per-token routing), backward recomputes and
  backpropagates `block_tokens` rows at a time.
- `gated_delta_rule_recomputed_in_blocks(...)`: for the gated delta rule, whose tokens are tied
  by the recurrent state, backward first replays the recurrence without autograd, in float64,
  to get the state entering each block (keeping what each block's backward reads of its
  forward), then walks the blocks last to first: take one block's vector-Jacobian product in
  float64 from its entering state (`longstraw.ops.gated_delta_rule_vjp`, written out by hand),
  with its output cotangent and the cotangent of its end state, and hand the entering state's
  cotangent to the previous block.

The delta rule's wrapper is also what branch replay backpropagates through
(`longstraw.engine.delta_rule`): its recomputation on LongStraw's chunked kernel, in float64,
keeps the decay gradients (A_log, dt_bias) as accurate as the fp32 inputs and outputs allow, which
autograd through transformers' kernel (or any fp32 backward of the chunked form) does not.

Peak memory of the backward is one block's graph plus the saved inputs, whatever T is. The cost
is one more forward of the function (for the gated delta rule a float64 one, and a float64 graph
of one block). The recomputation in backward may round differently from the forward (it runs on
blocks, and the gated delta rule on LongStraw's chunked kernel in float64); the gradients are
those of the same function to fp32 rounding, which the exact-gradient tests check against
full-sequence autograd.

Legend: T tokens, B batch, H heads, D dims; parameter gradients are summed over blocks in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from longstraw.ops import dispatch
from longstraw.ops.decay_gate import DecayGate, fp32_log_decays, gate_parts
from longstraw.ops.gated_delta_rule import chunked_in_float64
from longstraw.ops.gated_delta_rule_vjp import (
    KeptChunks,
    chunked_end_state_in_float64,
    chunked_vjp_in_float64,
)

# 256 tokens: four 64-token chunks of the gated delta rule per block; the MLP of a 512-wide,
# 1536-intermediate layer keeps ~6 MB per block instead of ~50 MB for a 2048-token shard.
BLOCK_TOKENS = 256


def _blocks(total: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(start + block, total)) for start in range(0, total, block)]


@dataclass(frozen=True)
class OutputProjection:
    """`fn(x) = projection(inner(x))` with `projection` a linear layer: the backward then
    recomputes only `inner` and takes the projection's gradients by hand (dW = dy^T h,
    dh = dy W), one matmul fewer per block than recomputing `fn` (a gated MLP's down projection:
    a third of its forward)."""

    inner: Callable[[torch.Tensor], torch.Tensor]
    projection: torch.nn.Linear


@dataclass(frozen=True)
class LowRank:
    """`scale · (x Aᵀ) Bᵀ` added to a projection's output: a LoRA adapter without dropout
    (`longstraw.models.lora.linear_parts` reads one from peft's layer)."""

    a: torch.Tensor
    """[r, in], in its own dtype (peft keeps adapters in fp32 under a bf16 base)."""
    b: torch.Tensor
    """[out, r]."""
    scale: float


@dataclass(frozen=True)
class GatedMlp:
    """`fn(x) = down(silu(gate(x)) * up(x))` with three bias-free linear layers (transformers'
    gated MLP with a SiLU), each with an optional low-rank adapter on its output (`low_rank`,
    in the order gate, up, down): the backward recomputes gate and up in one matmul against
    their stacked weights (plus each adapter's two thin ones) and takes every gradient by hand,
    so a block costs five matmuls — three when the weights are frozen — and no autograd graph
    (against seven and a graph through `OutputProjection`)."""

    gate: torch.nn.Linear
    up: torch.nn.Linear
    down: torch.nn.Linear
    low_rank: tuple[LowRank | None, LowRank | None, LowRank | None] = (None, None, None)


def _add_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, the product in the operands' dtype (a block's gradient, as autograd
    forms it) and the sum in `total`'s."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total.add_(a @ b)


class _LowRankGrads:
    """One adapter's blockwise products and its gradients' fp32 (or wider) sums."""

    def __init__(self, low_rank: LowRank, wanted: set[int]) -> None:
        self.lr = low_rank
        summed = torch.promote_types(low_rank.a.dtype, torch.float32)
        self.da = torch.zeros(low_rank.a.shape, dtype=summed, device=low_rank.a.device)
        self.db = torch.zeros(low_rank.b.shape, dtype=summed, device=low_rank.b.device)
        self.need_a, self.need_b = id(low_rank.a) in wanted, id(low_rank.b) in wanted

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        """x Aᵀ [n, r], in the adapter's dtype."""
        return x.to(self.lr.a.dtype) @ self.lr.a.T

    def output(self, xa: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The adapter's output scale · (x Aᵀ) Bᵀ [n, out], in `dtype` (peft's order)."""
        return ((xa @ self.lr.b.T) * self.lr.scale).to(dtype)

    def backward(
        self, x: torch.Tensor, xa: torch.Tensor, dy: torch.Tensor, need_x: bool
    ) -> torch.Tensor | None:
        """Add dA, dB of output cotangent `dy` [n, out] at input `x` [n, in] (`xa` = x Aᵀ);
        returns the adapter's share of dx, scale · (dy B) A in x's dtype (None without
        `need_x`)."""
        dyb = dy.to(self.lr.b.dtype) @ self.lr.b
        if self.need_b:
            _add_product(self.db, dy.to(xa.dtype).T, xa * self.lr.scale)
        if self.need_a:
            _add_product(self.da, (dyb * self.lr.scale).T, x.to(dyb.dtype))
        return ((dyb @ self.lr.a) * self.lr.scale).to(x.dtype) if need_x else None

    def grads(self) -> dict[int, torch.Tensor]:
        return {id(self.lr.a): self.da, id(self.lr.b): self.db}


def _gated_mlp_backward(
    mlp: GatedMlp,
    x_BTC: torch.Tensor,
    grad_out_BTC: torch.Tensor,
    block_tokens: int,
    need_x: bool,
    wanted: set[int] | None = None,
) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
    """(dx [B, T, C] or None, {id(parameter): its gradient, summed in fp32 or wider}) of `mlp`
    at `x_BTC` against `grad_out_BTC`, `block_tokens` rows at a time. `wanted`: ids of the
    parameters whose gradient is needed (None: every one); the weights' two gradient matmuls
    are skipped when none of the three is (a LoRA run: the base is frozen).

    Per block of rows x [n, C], with G = [W_gate; W_up] [2I, C]:
        [gate, up] = x G^T (+ each adapter's s (x A^T) B^T);  h = silu(gate) * up
        dW_down = dy^T h;  dh = dy W_down (+ s (dy B) A)
        d_up = dh * silu(gate);  d_gate = dh * up * s (1 + gate (1 - s)),  s = sigmoid(gate)
        dG = [d_gate, d_up]^T x;  dx = [d_gate, d_up] G (+ each adapter's s (d B) A)
    and per adapter dB = s d^T (x A^T), dA = s (d B)^T x with d its output's cotangent.
    """
    weights = (mlp.gate.weight, mlp.up.weight, mlp.down.weight)
    if wanted is None:
        wanted = {id(w) for w in weights} | {
            id(t) for lr in mlp.low_rank if lr is not None for t in (lr.a, lr.b)
        }
    need_weights = any(id(w) in wanted for w in weights)
    adapters = [None if lr is None else _LowRankGrads(lr, wanted) for lr in mlp.low_rank]
    gate_lr, up_lr, down_lr = adapters
    dtype = x_BTC.dtype
    stacked_IC = torch.cat([mlp.gate.weight, mlp.up.weight]).to(dtype)
    down_CI = mlp.down.weight.to(dtype)
    inter = mlp.gate.weight.shape[0]
    gate_cols, up_cols = slice(0, inter), slice(inter, None)
    x_NC = x_BTC.reshape(-1, x_BTC.shape[-1])
    dy_NC = grad_out_BTC.reshape(-1, grad_out_BTC.shape[-1])
    dx_NC = torch.empty_like(x_NC) if need_x else None
    # Summed over the blocks in fp32 at least (float64 for a float64 model).
    summed = torch.promote_types(dtype, torch.float32)
    d_stacked = d_down = None
    if need_weights:
        d_stacked = torch.zeros(stacked_IC.shape, dtype=summed, device=x_NC.device)
        d_down = torch.zeros(down_CI.shape, dtype=summed, device=x_NC.device)
    # Rows of a [B, T] batch are independent: blocks of `block_tokens` rows of the flattened
    # batch are what the other paths' [B, block_tokens] blocks are for B = 1.
    for start, end in _blocks(x_NC.shape[0], block_tokens):
        x = x_NC[start:end]
        dy = dy_NC[start:end]
        gate_up = x @ stacked_IC.T
        kept = {}
        for name, adapter, cols in (("gate", gate_lr, gate_cols), ("up", up_lr, up_cols)):
            if adapter is not None:
                kept[name] = adapter.inner(x)
                gate_up[:, cols] += adapter.output(kept[name], dtype)
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        act = torch.nn.functional.silu(gate)
        if need_weights or down_lr is not None:
            h = act * up
        if need_weights:
            _add_product(d_down, dy.T, h)
        dh = dy @ down_CI
        if down_lr is not None:
            dh += down_lr.backward(h, down_lr.inner(h), dy, need_x=True)
        d_gate_up = torch.empty_like(gate_up)
        torch.mul(dh, act, out=d_gate_up[:, inter:])
        # silu'(gate) = s + gate s (1 - s), formed in place from s = sigmoid(gate).
        slope = torch.sigmoid(gate)
        slope.mul_(gate.neg().mul_(slope).add_(gate).add_(1.0))
        torch.mul(dh, up, out=d_gate_up[:, :inter]).mul_(slope)
        if need_weights:
            _add_product(d_stacked, d_gate_up.T, x)
        if need_x:
            dx = dx_NC[start:end]
            torch.matmul(d_gate_up, stacked_IC, out=dx)
        for name, adapter, cols in (("gate", gate_lr, gate_cols), ("up", up_lr, up_cols)):
            if adapter is not None:
                share = adapter.backward(x, kept[name], d_gate_up[:, cols], need_x)
                if need_x:
                    dx += share
    grads = {}
    if need_weights:
        grads = {
            id(mlp.gate.weight): d_stacked[:inter],
            id(mlp.up.weight): d_stacked[inter:],
            id(mlp.down.weight): d_down,
        }
    for adapter in adapters:
        if adapter is not None:
            grads |= adapter.grads()
    return (None if dx_NC is None else dx_NC.view_as(x_BTC)), grads


def _add_into(dparams: list, i: int, grad: torch.Tensor | None) -> None:
    if grad is not None:
        dparams[i] = grad.float() if dparams[i] is None else dparams[i].add_(grad)


class _RowsRecomputedInBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, block_tokens, split, x_BTC, *params):
        ctx.fn, ctx.block_tokens, ctx.split, ctx.params = fn, block_tokens, split, params
        ctx.save_for_backward(x_BTC)
        with torch.no_grad():
            return fn(x_BTC)

    @staticmethod
    def backward(ctx, grad_out_BTC):
        (x_BTC,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[3]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        split: OutputProjection | GatedMlp | None = ctx.split
        if isinstance(split, GatedMlp):
            dx_BTC, by_weight = _gated_mlp_backward(
                split,
                x_BTC,
                grad_out_BTC,
                ctx.block_tokens,
                need_x,
                wanted={id(ctx.params[i]) for i in wanted},
            )
            return (None, None, None, dx_BTC, *_params_grads(ctx, by_weight))
        dx_BTC = torch.zeros_like(x_BTC) if need_x else None
        dparams: list[torch.Tensor | None] = [None] * len(ctx.params)
        by_hand = []
        if split is not None:
            # The projection's own parameters get their gradients by hand, not from autograd.
            own = {id(split.projection.weight), id(split.projection.bias)}
            by_hand = [i for i in wanted if id(ctx.params[i]) in own]
            wanted = [i for i in wanted if i not in by_hand]
        for start, end in _blocks(x_BTC.shape[1], ctx.block_tokens):
            x_block = x_BTC[:, start:end].detach().requires_grad_(need_x)
            grad_block = grad_out_BTC[:, start:end]
            with torch.enable_grad():
                out_block = ctx.fn(x_block) if split is None else split.inner(x_block)
            if split is not None:
                weight = split.projection.weight
                grad_rows = grad_block.reshape(-1, grad_block.shape[-1])
                for i in by_hand:
                    if ctx.params[i] is weight:
                        hidden_rows = out_block.detach().reshape(-1, out_block.shape[-1])
                        _add_into(dparams, i, grad_rows.T @ hidden_rows)
                    else:
                        _add_into(dparams, i, grad_rows.sum(0))
                grad_block = grad_block @ weight.to(grad_block.dtype)
            inputs = ([x_block] if need_x else []) + [ctx.params[i] for i in wanted]
            if not inputs:
                continue
            grads = list(torch.autograd.grad(out_block, inputs, grad_block, allow_unused=True))
            if need_x:
                dx_BTC[:, start:end] = grads.pop(0)
            for i, grad in zip(wanted, grads, strict=True):
                _add_into(dparams, i, grad)
        dparams_typed = [
            None if grad is None else grad.to(param.dtype)
            for grad, param in zip(dparams, ctx.params, strict=True)
        ]
        return (None, None, None, dx_BTC, *dparams_typed)


def _params_grads(ctx, by_weight: dict[int, torch.Tensor]) -> list[torch.Tensor | None]:
    """The gradients of `ctx.params` from {id(param): gradient}, in their dtypes (None
    where not asked for)."""
    return [
        by_weight[id(param)].to(param.dtype) if need else None
        for param, need in zip(ctx.params, ctx.needs_input_grad[4:], strict=True)
    ]


def rows_recomputed_in_blocks(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x_BTC: torch.Tensor,
    params: Sequence[torch.Tensor],
    *,
    block_tokens: int = BLOCK_TOKENS,
    split: OutputProjection | GatedMlp | None = None,
) -> torch.Tensor:
    """`fn(x_BTC)`, with a backward that recomputes `fn` on `block_tokens` rows at a time.

    `fn` must treat every token (dim 1) independently and read no tensor requiring grad other
    than `x_BTC` and `params` (its module's parameters), whose gradients it returns. Without
    grad, this is `fn(x_BTC)`. `split`: `fn` is `split.projection(split.inner(x))`, and the
    backward recomputes only `split.inner`; or `fn` is the `GatedMlp` `split`, whose backward
    is written out (the forward still runs `fn`).
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1; got {block_tokens}")
    if x_BTC.ndim != 3:
        raise ValueError(f"x must be [B, T, C]; got shape {tuple(x_BTC.shape)}")
    if not torch.is_grad_enabled():
        return fn(x_BTC)
    return _RowsRecomputedInBlocks.apply(fn, block_tokens, split, x_BTC, *params)


class _GatedDeltaRuleRecomputedInBlocks(torch.autograd.Function):
    # The log-decays come in as `formula(*gate)` (`longstraw.ops.decay_gate.gate_parts`): the
    # forward runs on them in fp32, the backward forms them in float64 and differentiates that.
    @staticmethod
    def forward(
        ctx, forward_fn, block_tokens, use_l2norm, formula, query, key, value, beta, state, *gate
    ):
        ctx.block_tokens, ctx.use_l2norm, ctx.formula = block_tokens, use_l2norm, formula
        ctx.save_for_backward(query, key, value, beta, state, *gate)
        with torch.no_grad():
            out, final = forward_fn(
                query,
                key,
                value,
                g=formula(*(x.float() for x in gate)),
                beta=beta,
                initial_state=state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=use_l2norm,
            )
        return out, final

    @staticmethod
    def backward(ctx, grad_out_BTHV, grad_final_BHKV):
        query, key, value, beta, state_BHKV, *gate = ctx.saved_tensors
        needs_gate = ctx.needs_input_grad[9:]
        gate_leaves = [
            x.detach().double().requires_grad_(need)
            for x, need in zip(gate, needs_gate, strict=True)
        ]
        with torch.enable_grad():
            g64 = ctx.formula(*gate_leaves)
        need_g = any(needs_gate)
        needs = (*ctx.needs_input_grad[4:7], need_g, ctx.needs_input_grad[7])
        blocks = _blocks(query.shape[1], ctx.block_tokens)

        # LongStraw's chunked kernel, in float64 (fla's, in the inputs' dtype, on CUDA when
        # opted in: `longstraw.ops.dispatch`).
        kernel = dispatch.ran(
            "linear_attention.recompute",
            dispatch.delta_rule_recompute_kernel(query.device, query.dtype),
        )
        in_float64 = kernel != dispatch.FLA
        if in_float64:
            run_block = chunked_in_float64
        else:
            fla = dispatch.fla_chunk_gated_delta_rule()

            def run_block(q, k, v, gb, bb, initial_state, use_qk_l2norm_in_kernel):
                return fla(
                    q,
                    k,
                    v,
                    g=gb,
                    beta=bb,
                    initial_state=initial_state.float(),
                    output_final_state=True,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                )

        # LongStraw's kernel: every block is recomputed and backpropagated in float64
        # (`chunked_in_float64`), from the state entering it, replayed without autograd in
        # float64 (the last block's end state is not needed); the entering state's cotangent is
        # handed on in float64 too. Nothing is rounded to fp32 but the gradients: with weak
        # decay, dA_log = sum_t g_t dg_t cancels 100-1000-fold, and an fp32 rounding anywhere —
        # of an entering state, of the state's cotangent between blocks, inside a block's
        # recomputation — is a perturbation whose effect on the decay gradients adds up over the
        # block's tokens. Measured (B=1, T=62, A = 0.001, blocks of 49): dA_log relative error
        # 5.1e-4 with fp32 blocks, 4.6e-6 with float64 ones (the fp32 recurrence: 2.0e-5).
        # fla's kernel gets the same float64 replay of the entering states, rounded to fp32 at
        # its interface, and the inputs and cotangents in their own dtypes.
        # The log-decays in float64, unrounded (fp32 for fla's kernel); their cotangent is
        # gathered over the blocks and differentiated through their formation once, after them.
        g_blocks = g64.detach() if in_float64 else g64.detach().float()
        inputs = (query, key, value, g_blocks, beta)
        work = torch.float64 if in_float64 else None
        entering = [state_BHKV.double()]
        # LongStraw's kernel: the replay keeps, per block, what the block's vector-Jacobian
        # product reads of its forward (`KeptChunks`: the UT transform, the states entering its
        # chunks, the new values; 6 float64 tensors of a block's size, about 6 MB for 256 tokens
        # of 8 heads of 64), so no block's forward runs twice; freed block by block below.
        kept: list[KeptChunks | None] = []
        with torch.no_grad():
            for start, end in blocks[:-1]:
                if in_float64:
                    end_state, pieces = chunked_end_state_in_float64(
                        *(x[:, start:end] for x in inputs),
                        initial_state=entering[-1],
                        use_qk_l2norm_in_kernel=ctx.use_l2norm,
                    )
                    kept.append(pieces)
                else:
                    _, end_state = chunked_in_float64(
                        *(x[:, start:end] for x in inputs),
                        initial_state=entering[-1],
                        use_qk_l2norm_in_kernel=ctx.use_l2norm,
                    )
                entering.append(end_state)
        kept.append(None)

        grads_in = [
            torch.zeros_like(x) if need else None for x, need in zip(inputs, needs, strict=True)
        ]
        cot_state = (
            torch.zeros_like(entering[0]) if grad_final_BHKV is None else grad_final_BHKV.double()
        )
        for (start, end), start_state in zip(reversed(blocks), reversed(entering), strict=True):
            if in_float64:
                # The block's vector-Jacobian product written out in float64
                # (`chunked_vjp_in_float64`: autograd's through `chunked_in_float64`, to float64
                # rounding, without its output and per-chunk bookkeeping).
                *grads, cot_state = chunked_vjp_in_float64(
                    *(x[:, start:end] for x in inputs),
                    initial_state=start_state,
                    grad_out=grad_out_BTHV[:, start:end],
                    grad_final=cot_state,
                    use_qk_l2norm_in_kernel=ctx.use_l2norm,
                    kept=kept.pop(),
                )
                for i, grad in enumerate(grads):
                    if needs[i]:
                        grads_in[i][:, start:end] = grad
                continue
            leaves = [
                x[:, start:end].detach().to(work or x.dtype).requires_grad_(need)
                for x, need in zip(inputs, needs, strict=True)
            ]
            state_leaf = start_state.detach().requires_grad_(True)
            with torch.enable_grad():
                out, end_state = run_block(
                    *leaves, initial_state=state_leaf, use_qk_l2norm_in_kernel=ctx.use_l2norm
                )
            wanted = [i for i, need in enumerate(needs) if need]
            *grads, grad_state = torch.autograd.grad(
                (out, end_state),
                [leaves[i] for i in wanted] + [state_leaf],
                (grad_out_BTHV[:, start:end].to(out.dtype), cot_state.to(end_state.dtype)),
                allow_unused=True,
            )
            for i, grad in zip(wanted, grads, strict=True):
                if grad is not None:
                    grads_in[i][:, start:end] = grad
            cot_state = torch.zeros_like(cot_state) if grad_state is None else grad_state
        grad_state = cot_state.to(state_BHKV.dtype) if ctx.needs_input_grad[8] else None
        grad_gate: list[torch.Tensor | None] = [None] * len(gate)
        wanted_gate = [i for i, need in enumerate(needs_gate) if need]
        if wanted_gate:
            grads = torch.autograd.grad(
                g64, [gate_leaves[i] for i in wanted_gate], grads_in[3].double(), allow_unused=True
            )
            for i, grad in zip(wanted_gate, grads, strict=True):
                grad_gate[i] = None if grad is None else grad.to(gate[i].dtype)
        dq, dk, dv, _, dbeta = grads_in
        return (None, None, None, None, dq, dk, dv, dbeta, grad_state, *grad_gate)


def gated_delta_rule_recomputed_in_blocks(
    forward_fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor | DecayGate,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    block_tokens: int = BLOCK_TOKENS,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`forward_fn(...)` (a gated delta rule with transformers' signature; see
    `longstraw.ops.gated_delta_rule`), with a backward that recomputes `block_tokens` tokens at a
    time from the state entering each block, on LongStraw's chunked kernel in float64.

    `g` may be the `DecayGate` that forms the log-decays (`longstraw.ops.decay_gate`):
    `forward_fn` gets the fp32 log-decays it forms, and the backward differentiates their
    formation in float64 too.

    Returns (output [B, T, Hv, Dv], final state [B, Hv, Dk, Dv] fp32 or None). Without grad, or
    for packed sequences (`cu_seqlens`), this is `forward_fn(...)` unchanged.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1; got {block_tokens}")
    call_as_is = not torch.is_grad_enabled() or kwargs.get("cu_seqlens") is not None
    if call_as_is:
        return forward_fn(
            query,
            key,
            value,
            g=fp32_log_decays(g),
            beta=beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            **kwargs,
        )
    B, _, _, Dk = key.shape
    Hv, Dv = value.shape[2:]
    if initial_state is None:
        initial_state = torch.zeros(B, Hv, Dk, Dv, dtype=torch.float32, device=value.device)
    formula, gate = gate_parts(g)
    out, final = _GatedDeltaRuleRecomputedInBlocks.apply(
        forward_fn,
        block_tokens,
        use_qk_l2norm_in_kernel,
        formula,
        query,
        key,
        value,
        beta,
        initial_state,
        *gate,
    )
    return out, (final if output_final_state else None)
