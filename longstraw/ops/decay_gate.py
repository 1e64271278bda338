"""Gated DeltaNet's log-decays given by the inputs that form them, so a kernel's backward can
differentiate through their formation in float64.

Gated DeltaNet (qwen3_5, qwen3_next) forms one log-decay per token and value head,

    g = -exp(A_log) * softplus(a + dt_bias)        a [B, T, Hv]; A_log, dt_bias [Hv],

in fp32, and hands `g` to the delta rule. The decay parameters' gradients are sums over every
token, dA_log = sum_t g_t dg_t and ddt_bias = sum_t dg_t dg_t/dx_t, which with weak decay cancel
100-1000-fold. With `g` as a tensor, a kernel whose backward is float64 inside still returns dg
rounded to fp32, and autograd then forms and sums those products in fp32: each rounding is
multiplied by the cancellation. Given a `DecayGate`, the kernels
(`longstraw.ops.gated_delta_rule`, `longstraw.ops.blockwise_backward`) run their forward on the
fp32 `g` the model forms, bit for bit, and differentiate the formula itself in float64 in their
backward, from the unrounded float64 decays, rounding the gradients of `a`, `A_log` and `dt_bias`
to their dtypes once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def log_decays(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """-exp(A_log) * softplus(a + dt_bias) in the inputs' dtype: [B, T, Hv]."""
    return -A_log.exp() * F.softplus(a + dt_bias)


@dataclass(frozen=True)
class DecayGate:
    """The inputs of Gated DeltaNet's log-decays: a [B, T, Hv] (any float dtype), A_log and
    dt_bias [Hv] (the layer's parameters)."""

    a: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor

    def fp32(self) -> torch.Tensor:
        """The log-decays as transformers' layers form them, bit for bit: [B, T, Hv] fp32."""
        return log_decays(self.a.float(), self.A_log.float(), self.dt_bias.float())

    @property
    def shape(self) -> torch.Size:
        return self.a.shape


def _identity(g: torch.Tensor) -> torch.Tensor:
    return g


def gate_parts(
    g: torch.Tensor | DecayGate,
) -> tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]:
    """(formula, tensors): `formula(*tensors)` is the log-decays in the tensors' dtype — the
    identity of `g` itself, or `log_decays` of a gate's inputs. A kernel's backward calls the
    formula on float64 copies of the tensors."""
    if isinstance(g, DecayGate):
        return log_decays, (g.a, g.A_log, g.dt_bias)
    return _identity, (g,)


def fp32_log_decays(g: torch.Tensor | DecayGate) -> torch.Tensor:
    """The fp32 log-decays a kernel's forward runs on."""
    return g.fp32() if isinstance(g, DecayGate) else g
