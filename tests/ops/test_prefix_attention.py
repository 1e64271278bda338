"""prefix_cached_attention against the materialising reference: outputs, all gradients, memory contract."""

import pytest
import torch
from torch import Tensor

from longstraw.ops.attention_reference import naive_prefix_attention
from longstraw.ops.partial_attention import merge_partial_attention
from longstraw.ops.prefix_attention import prefix_cached_attention

SEED = 42
# fp32 reorderings (chunked online softmax vs one softmax): STYLE.md tolerances.
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
# bf16 inputs, fp32 accumulation, vs the fp32 reference: bf16 rounding of out, dq, dk, dv.
BF16_TOL = 2e-2


def _make_inputs(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    branch_len: int,
    prefix_len: int,
    head_dim: int,
    value_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = SEED,
) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return {
        "q_BHRD": randn(batch, num_heads, branch_len, head_dim),
        "k_branch_BKRD": randn(batch, num_kv_heads, branch_len, head_dim),
        "v_branch_BKRD": randn(batch, num_kv_heads, branch_len, value_dim),
        "k_prefix_TKD": randn(prefix_len, num_kv_heads, head_dim),
        "v_prefix_TKD": randn(prefix_len, num_kv_heads, value_dim),
        "grad_out_BHRV": randn(batch, num_heads, branch_len, value_dim),
    }


def _assert_close(actual: Tensor, expected: Tensor, *, what: str, rtol: float, atol: float) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    diff = (actual.double() - expected.double()).abs()
    bound = atol + rtol * expected.double().abs()
    if diff.numel() and not bool((diff <= bound).all()):
        raise AssertionError(
            f"{what}: max_diff={diff.max().item():.3e} mean_diff={diff.mean().item():.3e} "
            f"(rtol={rtol}, atol={atol})"
        )


def _fast_run(inputs: dict[str, Tensor], *, chunk_size: int, with_prefix_grad: bool = True):
    """Forward + backward of the fast op; returns (out, dq, dk_branch, dv_branch, dk_prefix, dv_prefix)."""
    q, kb, vb = (
        inputs[n].clone().requires_grad_() for n in ("q_BHRD", "k_branch_BKRD", "v_branch_BKRD")
    )
    kp, vp = inputs["k_prefix_TKD"], inputs["v_prefix_TKD"]
    grad_k = torch.zeros(kp.shape) if with_prefix_grad else None
    grad_v = torch.zeros(vp.shape) if with_prefix_grad else None
    out = prefix_cached_attention(
        q,
        kb,
        vb,
        kp,
        vp,
        scale=q.shape[-1] ** -0.5,
        chunk_size=chunk_size,
        prefix_grad_k_TKD=grad_k,
        prefix_grad_v_TKD=grad_v,
    )
    out.backward(inputs["grad_out_BHRV"])
    return out.detach(), q.grad, kb.grad, vb.grad, grad_k, grad_v


def _naive_run(inputs: dict[str, Tensor], *, dtype: torch.dtype = torch.float32):
    names = ("q_BHRD", "k_branch_BKRD", "v_branch_BKRD", "k_prefix_TKD", "v_prefix_TKD")
    leaves = [inputs[n].to(dtype).clone().requires_grad_() for n in names]
    out = naive_prefix_attention(*leaves, scale=leaves[0].shape[-1] ** -0.5)
    out.backward(inputs["grad_out_BHRV"].to(dtype))
    return (out.detach(), *(leaf.grad for leaf in leaves))


_RESULT_NAMES = ("out", "dq", "dk_branch", "dv_branch", "dk_prefix", "dv_prefix")


# (B, H, K, D, V): GQA with a value head dim unlike the query/key one, and plain MHA.
HEAD_CONFIGS = [(1, 4, 2, 8, 12), (3, 4, 4, 16, 16), (3, 4, 2, 16, 8), (1, 4, 4, 8, 8)]


@pytest.mark.parametrize("chunk_size", [7, 64])
@pytest.mark.parametrize("branch_len", [1, 5, 17])
@pytest.mark.parametrize("prefix_len", [0, 1, 63, 1000])
@pytest.mark.parametrize("heads", HEAD_CONFIGS, ids=lambda h: "B{}H{}K{}D{}V{}".format(*h))
def test_prefix_cached_attention_matches_naive_outputs_and_all_gradients(
    heads, prefix_len, branch_len, chunk_size
):
    batch, num_heads, num_kv_heads, head_dim, value_dim = heads
    inputs = _make_inputs(
        batch, num_heads, num_kv_heads, branch_len, prefix_len, head_dim, value_dim
    )
    fast = _fast_run(inputs, chunk_size=chunk_size)
    naive = _naive_run(inputs)
    for name, actual, expected in zip(_RESULT_NAMES, fast, naive, strict=True):
        _assert_close(actual, expected, what=name, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_long_shard_matches_naive_as_in_the_reverse_sweep():
    # A prefill shard replays as a 300-token "branch" over 257 earlier tokens; chunk 64 splits
    # both into uneven pieces, so queries and keys are blocked and the causal mask crosses blocks.
    inputs = _make_inputs(1, 4, 2, 300, 257, 16, 16)
    fast = _fast_run(inputs, chunk_size=64)
    naive = _naive_run(inputs)
    for name, actual, expected in zip(_RESULT_NAMES, fast, naive, strict=True):
        _assert_close(actual, expected, what=name, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_detached_prefix_gets_no_gradient_and_branch_gradients_still_match():
    inputs = _make_inputs(3, 4, 2, 17, 63, 8, 12)
    fast = _fast_run(inputs, chunk_size=7, with_prefix_grad=False)
    naive = _naive_run(inputs)
    assert fast[4] is None and fast[5] is None
    for name, actual, expected in zip(_RESULT_NAMES[:4], fast[:4], naive[:4], strict=True):
        _assert_close(actual, expected, what=name, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_prefix_gradient_buffers_accumulate_over_two_branches():
    first = _make_inputs(3, 4, 2, 5, 63, 8, 12, seed=SEED)
    second = _make_inputs(3, 4, 2, 17, 63, 8, 12, seed=SEED + 1)
    # Both branches read the same prompt state.
    second["k_prefix_TKD"], second["v_prefix_TKD"] = first["k_prefix_TKD"], first["v_prefix_TKD"]
    grad_k = torch.zeros(first["k_prefix_TKD"].shape)
    grad_v = torch.zeros(first["v_prefix_TKD"].shape)
    for inputs in (first, second):
        q = inputs["q_BHRD"].clone().requires_grad_()
        out = prefix_cached_attention(
            q,
            inputs["k_branch_BKRD"],
            inputs["v_branch_BKRD"],
            inputs["k_prefix_TKD"],
            inputs["v_prefix_TKD"],
            scale=8**-0.5,
            chunk_size=7,
            prefix_grad_k_TKD=grad_k,
            prefix_grad_v_TKD=grad_v,
        )
        out.backward(inputs["grad_out_BHRV"])
    naive_first, naive_second = _naive_run(first), _naive_run(second)
    _assert_close(
        grad_k, naive_first[4] + naive_second[4], what="dk_prefix", rtol=FP32_RTOL, atol=FP32_ATOL
    )
    _assert_close(
        grad_v, naive_first[5] + naive_second[5], what="dv_prefix", rtol=FP32_RTOL, atol=FP32_ATOL
    )


def test_two_uses_in_one_graph_match_naive():
    # Two "layers": the second layer's queries depend on the first layer's output; one backward.
    inputs = _make_inputs(3, 4, 2, 17, 63, 8, 8)
    layer2 = _make_inputs(3, 4, 2, 17, 63, 8, 8, seed=SEED + 1)

    def two_layers(attend, q, kb, vb, kp1, vp1, kp2, vp2, **buffers):
        hidden = attend(q, kb, vb, kp1, vp1, **buffers.get("first", {}))
        return attend(hidden + q, kb, vb, kp2, vp2, **buffers.get("second", {}))

    q, kb, vb = (
        inputs[n].clone().requires_grad_() for n in ("q_BHRD", "k_branch_BKRD", "v_branch_BKRD")
    )
    kp1, vp1, kp2, vp2 = (
        inputs["k_prefix_TKD"],
        inputs["v_prefix_TKD"],
        layer2["k_prefix_TKD"],
        layer2["v_prefix_TKD"],
    )
    grads = [
        torch.zeros(kp1.shape),
        torch.zeros(vp1.shape),
        torch.zeros(kp2.shape),
        torch.zeros(vp2.shape),
    ]

    def fast(q, kb, vb, kp, vp, **kw):
        return prefix_cached_attention(q, kb, vb, kp, vp, scale=8**-0.5, chunk_size=7, **kw)

    out = two_layers(
        fast,
        q,
        kb,
        vb,
        kp1,
        vp1,
        kp2,
        vp2,
        first={"prefix_grad_k_TKD": grads[0], "prefix_grad_v_TKD": grads[1]},
        second={"prefix_grad_k_TKD": grads[2], "prefix_grad_v_TKD": grads[3]},
    )
    out.backward(inputs["grad_out_BHRV"])

    ref_leaves = [
        t.clone().requires_grad_()
        for t in (q.detach(), kb.detach(), vb.detach(), kp1, vp1, kp2, vp2)
    ]
    ref_out = two_layers(lambda *a: naive_prefix_attention(*a, scale=8**-0.5), *ref_leaves)
    ref_out.backward(inputs["grad_out_BHRV"])

    _assert_close(out.detach(), ref_out.detach(), what="out", rtol=FP32_RTOL, atol=FP32_ATOL)
    actual = [q.grad, kb.grad, vb.grad, *grads]
    names = ["dq", "dk_branch", "dv_branch", "dk_prefix1", "dv_prefix1", "dk_prefix2", "dv_prefix2"]
    for name, a, leaf in zip(names, actual, ref_leaves, strict=True):
        _assert_close(a, leaf.grad, what=name, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_bf16_inputs_match_fp32_reference():
    inputs = _make_inputs(3, 4, 2, 17, 1000, 16, 8, dtype=torch.bfloat16)
    fast = _fast_run(inputs, chunk_size=64)
    naive = _naive_run(inputs, dtype=torch.float32)
    assert fast[0].dtype == torch.bfloat16
    assert fast[1].dtype == torch.bfloat16
    for name, actual, expected in zip(_RESULT_NAMES, fast, naive, strict=True):
        # RMS-relative: single bf16 elements near zero carry no meaningful relative error.
        rms_err = (actual.float() - expected).pow(2).mean().sqrt()
        rms_ref = expected.pow(2).mean().sqrt()
        assert rms_err <= BF16_TOL * rms_ref, (
            f"{name}: rms_rel={(rms_err / rms_ref).item():.3e} "
            f"max_diff={(actual.float() - expected).abs().max().item():.3e}"
        )


def test_float64_gradcheck_passes():
    # fp64 inputs stay fp64 inside the op, so finite differences check the backward formulas.
    inputs = _make_inputs(2, 4, 2, 5, 9, 3, 4, dtype=torch.float64)
    q, kb, vb = (
        inputs[n].clone().requires_grad_() for n in ("q_BHRD", "k_branch_BKRD", "v_branch_BKRD")
    )

    def fn(q, kb, vb):
        return prefix_cached_attention(
            q, kb, vb, inputs["k_prefix_TKD"], inputs["v_prefix_TKD"], scale=0.7, chunk_size=2
        )

    assert torch.autograd.gradcheck(fn, (q, kb, vb))


def _saved_numels(prefix_len: int) -> list[int]:
    inputs = _make_inputs(1, 4, 2, 5, prefix_len, 8, 8)
    q = inputs["q_BHRD"].clone().requires_grad_()
    numels: list[int] = []

    def pack(x: Tensor) -> Tensor:
        numels.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = prefix_cached_attention(
            q,
            inputs["k_branch_BKRD"],
            inputs["v_branch_BKRD"],
            inputs["k_prefix_TKD"],
            inputs["v_prefix_TKD"],
            scale=0.3,
            chunk_size=64,
            prefix_grad_k_TKD=torch.zeros(inputs["k_prefix_TKD"].shape),
            prefix_grad_v_TKD=torch.zeros(inputs["v_prefix_TKD"].shape),
        )
    out.sum().backward()
    return numels


def test_nothing_saved_for_backward_grows_with_prefix_length():
    short, long = _saved_numels(100), _saved_numels(1000)
    assert short, "the op saved nothing: the hook did not see the autograd Function"
    assert short == long, f"saved numels depend on T: T=100 {short} vs T=1000 {long}"
    # Branch-sized only: 4 * 5 * 8 = 160 elements is the largest saved tensor here.
    assert max(long) <= 160, f"saved a tensor of {max(long)} elements for a 5-token branch"


@pytest.mark.parametrize("batch", [1, 3])
def test_prefix_tensors_are_bitwise_unchanged_after_forward_and_backward(batch):
    inputs = _make_inputs(batch, 4, 2, 17, 63, 8, 12)
    # The state stores one [L, T, K, D] buffer per kind; a layer's prefix is a view into it.
    k_state_LTKD = torch.stack([inputs["k_prefix_TKD"]] * 3)
    v_state_LTKD = torch.stack([inputs["v_prefix_TKD"]] * 3)
    k_before, v_before = k_state_LTKD.clone(), v_state_LTKD.clone()
    view = dict(inputs, k_prefix_TKD=k_state_LTKD[1], v_prefix_TKD=v_state_LTKD[1])
    _fast_run(view, chunk_size=7)
    assert torch.equal(k_state_LTKD, k_before) and torch.equal(v_state_LTKD, v_before)


@pytest.mark.parametrize("batch", [1, 3])
def test_branch_inputs_are_bitwise_unchanged_after_forward_and_backward(batch):
    # With B = 1 and fp32 the op's internal layouts can alias the inputs: it must not write them.
    inputs = _make_inputs(batch, 4, 2, 17, 63, 8, 12)
    names = ("q_BHRD", "k_branch_BKRD", "v_branch_BKRD", "grad_out_BHRV")
    before = {n: inputs[n].clone() for n in names}
    q, kb, vb = (inputs[n].requires_grad_() for n in names[:3])
    out = prefix_cached_attention(
        q, kb, vb, inputs["k_prefix_TKD"], inputs["v_prefix_TKD"], scale=0.3, chunk_size=7
    )
    out.backward(inputs["grad_out_BHRV"])
    for n in names:
        assert torch.equal(inputs[n].detach(), before[n]), f"{n} was written in place"


def test_non_contiguous_prefix_and_query_views_match_naive():
    inputs = _make_inputs(3, 4, 2, 17, 63, 8, 12)
    # Prefix stored kv-head-major and read through a transpose; q as [B, R, H, D].transpose(1, 2),
    # as attention modules produce it.
    k_KTD = inputs["k_prefix_TKD"].transpose(0, 1).contiguous()
    q_BRHD = inputs["q_BHRD"].transpose(1, 2).contiguous()
    view = dict(inputs, k_prefix_TKD=k_KTD.transpose(0, 1), q_BHRD=q_BRHD.transpose(1, 2))
    assert not view["k_prefix_TKD"].is_contiguous() and not view["q_BHRD"].is_contiguous()
    fast = _fast_run(view, chunk_size=7)
    naive = _naive_run(inputs)
    for name, actual, expected in zip(_RESULT_NAMES, fast, naive, strict=True):
        _assert_close(actual, expected, what=name, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_writing_the_prefix_between_forward_and_backward_raises():
    inputs = _make_inputs(1, 4, 2, 5, 63, 8, 8)
    q = inputs["q_BHRD"].clone().requires_grad_()
    out = prefix_cached_attention(
        q,
        inputs["k_branch_BKRD"],
        inputs["v_branch_BKRD"],
        inputs["k_prefix_TKD"],
        inputs["v_prefix_TKD"],
        scale=0.3,
    )
    inputs["v_prefix_TKD"].mul_(2.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


def test_merge_of_two_partials_matches_one_softmax():
    gen = torch.Generator().manual_seed(SEED)
    scores_RL = torch.randn(5, 63, generator=gen)
    v_LV = torch.randn(63, 4, generator=gen)
    expected = torch.softmax(scores_RL, -1) @ v_LV
    parts = []
    for cols in (slice(0, 20), slice(20, 63)):
        s = scores_RL[:, cols]
        parts += [torch.softmax(s, -1) @ v_LV[cols], torch.logsumexp(s, -1)]
    out, lse = merge_partial_attention(*parts)
    _assert_close(out, expected, what="out", rtol=FP32_RTOL, atol=FP32_ATOL)
    _assert_close(lse, torch.logsumexp(scores_RL, -1), what="lse", rtol=FP32_RTOL, atol=FP32_ATOL)
    # A partial with no keys (lse = -inf, out NaN) contributes nothing.
    empty_out, empty_lse = torch.full((5, 4), float("nan")), torch.full((5,), float("-inf"))
    out_e, lse_e = merge_partial_attention(empty_out, empty_lse, expected, lse)
    assert torch.equal(out_e, expected) and torch.equal(lse_e, lse)


def _bad(**changes: object) -> dict[str, object]:
    inputs = _make_inputs(1, 4, 2, 5, 63, 8, 8)
    args: dict[str, object] = {k: v for k, v in inputs.items() if k != "grad_out_BHRV"}
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"q_BHRD": torch.zeros(1, 3, 5, 8)}, "multiple of kv heads"),
        ({"q_BHRD": torch.zeros(4, 5, 8)}, "q_BHRD must have 4 dims"),
        ({"k_branch_BKRD": torch.zeros(2, 2, 5, 8)}, "batch mismatch"),
        ({"k_branch_BKRD": torch.zeros(1, 2, 6, 8)}, "branch length mismatch"),
        ({"v_branch_BKRD": torch.zeros(1, 2, 4, 8)}, "branch length mismatch"),
        ({"k_prefix_TKD": torch.zeros(63, 2, 7)}, "head dim mismatch"),
        ({"k_prefix_TKD": torch.zeros(63, 1, 8)}, "kv head mismatch"),
        ({"v_prefix_TKD": torch.zeros(63, 2, 6)}, "value head dim mismatch"),
        ({"v_prefix_TKD": torch.zeros(62, 2, 8)}, "prefix length mismatch"),
        ({"k_prefix_TKD": torch.zeros(63, 8)}, "k_prefix_TKD must have 3 dims"),
        ({"chunk_size": 0}, "chunk_size must be a positive int"),
        ({"prefix_grad_k_TKD": torch.zeros(62, 2, 8)}, "prefix_grad_k_TKD has shape"),
        ({"prefix_grad_v_TKD": torch.zeros(63, 2, 8, dtype=torch.bfloat16)}, "must be float32"),
        ({"k_prefix_TKD": torch.zeros(63, 2, 8, requires_grad=True)}, "pass detached prefix"),
        (
            {
                "q_BHRD": torch.zeros(1, 4, 0, 8),
                "k_branch_BKRD": torch.zeros(1, 2, 0, 8),
                "v_branch_BKRD": torch.zeros(1, 2, 0, 8),
            },
            "R = 0",
        ),
    ],
)
def test_bad_shapes_raise_value_error_naming_the_mismatch(changes, message):
    args = _bad(**changes)
    with pytest.raises(ValueError, match=message):
        prefix_cached_attention(**args, scale=0.3)
