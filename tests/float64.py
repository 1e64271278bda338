"""Float64 truths for gradient tests: every operation of a computation in float64.

`model.double()` alone is not float64: transformers 5.24's modeling code casts to float32 inside
RMSNorm (`hidden_states.to(torch.float32)`), the Gated DeltaNet gate (`-A_log.float().exp()`)
and its delta rule kernels (q, k, v, g, beta `.to(torch.float32)`), the MoE routers and the rotary
embedding, and LongStraw's own kernels cast to float32 the same way. A "float64" reference built
by `.double()` still runs the delta rule in fp32 — with transformers' own rounding, so that
transformers' fp32 gradient looks accurate against it and any other correct fp32 computation does
not. `float64_computation()` turns every float32 request (casts, `dtype=` arguments) into float64
for the duration of the block; `no_float32_left()` checks that nothing narrower was computed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class _Float32AsFloat64(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        if func is torch.Tensor.float:
            return args[0].double()
        if func in (torch.Tensor.to, torch.Tensor.type):
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


def float64_computation() -> contextlib.AbstractContextManager:
    """Inside the block, a float32 cast or `dtype=torch.float32` produces float64 instead.

    Only what runs inside the block is affected. Autograd's backward of float64 tensors is
    float64 by itself, but a forward recomputed during backward (activation checkpointing, an
    autograd Function that recomputes) runs outside the mode: truths must not recompute.
    """
    return _Float32AsFloat64()


class _LowPrecisionSeen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dtype in (
                torch.float32,
                torch.bfloat16,
                torch.float16,
            ):
                self.ops.add(str(func))
        return out


@contextlib.contextmanager
def no_float32_left() -> Iterator[None]:
    """Fail if any operation inside the block produced a floating tensor narrower than float64."""
    seen = _LowPrecisionSeen()
    with seen:
        yield
    assert not seen.ops, f"operations that produced a float32/bf16 tensor: {sorted(seen.ops)}"


def relative_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """||actual - truth|| / ||truth|| in float64 (0 when both are zero)."""
    num = (actual.double() - truth.double()).norm()
    den = truth.double().norm()
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / den)


def relative_errors(
    actual: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]
) -> dict[str, float]:
    assert actual.keys() == truth.keys(), sorted(set(actual) ^ set(truth))
    return {name: relative_error(actual[name], ref) for name, ref in truth.items()}
