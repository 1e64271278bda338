"""Which kernel runs at each call site: one decision per call, from what the inputs are and what
is installed, and a once-per-site log line saying what ran.

Call sites (`SITES`) and their kernels, first applicable wins:

| site | kernel | when |
|---|---|---|
| `full_attention.prefix`, `full_attention.branch`, `full_attention.decode` | `aten-cpu-flash` | CPU, queries fp32/bf16, keys and values in the queries' dtype, V = D |
| `full_attention.backward` | `aten-cpu-flash` | CPU, queries, keys, values and output fp32, V = D: PyTorch's fused CPU flash backward, one call per prefix chunk and one for the causal branch |
| `full_attention.prefix`, `full_attention.decode` | `flash-attn` | CUDA, flash-attn imports, queries bf16/fp16, keys/values in that dtype, V = D <= 256, D % 8 = 0 |
| every attention site | `torch` | otherwise: LongStraw's chunked online softmax |
| `linear_attention.recompute` | `fla` | CUDA, fla imports, inputs bf16/fp16, and `LONGSTRAW_FLA_RECOMPUTE=1` |
| `linear_attention.recompute` | `torch` | otherwise: LongStraw's chunked kernel in float64 (`ops.gated_delta_rule.chunked_in_float64`) |

The CPU rules are the ones each call site applied before this module existed, so CPU results
are bit for bit what they were. The GPU kernels have not run on a GPU yet: they are written
against the packages' documented APIs (flash-attn's `flash_attn_func(..., return_attn_probs=True)`
returning the log-sum-exp, fla's `chunk_gated_delta_rule(initial_state=, output_final_state=)`)
and chosen only where the package imports
and the tensors are on CUDA. fla's recomputation is also opt-in: it replaces the kernel the exact
gradient's decay-parameter accuracy was measured with, and the float64 test that sets that bar
(`tests/ops/test_gated_delta_rule_float64.py`) has no CUDA case for fla yet.

The log: the first call of each (site, kernel) writes one INFO line on the `longstraw.kernels`
logger; `kernels_ran()` says what each site ran since `reset_log()`.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

import torch

ATEN_CPU_FLASH = "aten-cpu-flash"
FLASH_ATTN = "flash-attn"
FLA = "fla"
TORCH = "torch"

SITES = (
    "full_attention.prefix",
    "full_attention.branch",
    "full_attention.decode",
    "full_attention.backward",
    "linear_attention.recompute",
)
"""Every call site that asks this module for a kernel."""

# PyTorch's fused CPU flash attention returns the log-sum-exp beside the output (absent from
# builds without it: then every CPU site takes the torch path).
CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
CPU_FLASH_BACKWARD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)

# flash-attn 2 runs fp16/bf16 only, head dims up to 256 in multiples of 8, and one head dim for
# keys and values.
_FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_ATTN_MAX_HEAD_DIM = 256
# fla's chunked gated delta rule refuses fp32 inputs in its releases up to now.
_FLA_DTYPES = (torch.float16, torch.bfloat16)
FLA_RECOMPUTE_ENV = "LONGSTRAW_FLA_RECOMPUTE"

logger = logging.getLogger("longstraw.kernels")
_ran: dict[str, set[str]] = {}


@functools.cache
def installed(module: str) -> ModuleType | None:
    """The imported package `module`, or None when it is absent or fails to import (a broken
    GPU build must fall back, not stop the run). Cached: cleared by tests that fake a package."""
    try:
        return importlib.import_module(module)
    except Exception:
        return None


def ran(site: str, kernel: str) -> str:
    """Record that `site` ran `kernel` (one log line the first time); returns `kernel`."""
    assert site in SITES, site
    seen = _ran.setdefault(site, set())
    if kernel not in seen:
        seen.add(kernel)
        logger.info("kernel for %s: %s", site, kernel)
    return kernel


def kernels_ran() -> dict[str, str]:
    """{site: the kernels it ran since `reset_log()`, comma-separated}."""
    return {site: ", ".join(sorted(kernels)) for site, kernels in _ran.items()}


def reset_log() -> None:
    _ran.clear()


# --- attention ---------------------------------------------------------------------------------


def attention_kernel(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    value_dim: int,
    kv_dtypes: tuple[torch.dtype, ...] = (),
    *,
    gpu: bool = True,
) -> str:
    """The kernel for a partial attention of queries in `dtype` on `device` over keys of
    `head_dim` and values of `value_dim` stored in `kv_dtypes` (empty: the queries' dtype).
    `gpu=False` for a site that has no GPU kernel (the causal branch partial)."""
    same_dtype = all(d == dtype for d in kv_dtypes)
    if device.type == "cpu":
        fused = (
            CPU_FLASH is not None
            and dtype in (torch.float32, torch.bfloat16)
            and same_dtype
            and head_dim == value_dim
        )
        return ATEN_CPU_FLASH if fused else TORCH
    if (
        gpu
        and device.type == "cuda"
        and dtype in _FLASH_ATTN_DTYPES
        and same_dtype
        and head_dim == value_dim
        and head_dim <= _FLASH_ATTN_MAX_HEAD_DIM
        and head_dim % 8 == 0
        and installed("flash_attn") is not None
    ):
        return FLASH_ATTN
    return TORCH


def attention_backward_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int, value_dim: int
) -> str:
    """The kernel for the prefix-cached attention's backward: PyTorch's fused CPU flash
    backward for fp32 on CPU (its partial over each key chunk, given the global output and
    log-sum-exp, is that chunk's share of the gradient: FlashAttention-2's backward), else
    LongStraw's chunked loop."""
    if (
        device.type == "cpu"
        and CPU_FLASH_BACKWARD is not None
        and dtype == torch.float32
        and head_dim == value_dim
    ):
        return ATEN_CPU_FLASH
    return TORCH


def flash_attn_partial(
    q_BXRD: torch.Tensor, k_CKD: torch.Tensor, v_CKD: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, X, R, D] fp32, lse [B, X, R] fp32) of B * R query rows of X heads over one
    chunk of C keys of K kv heads (every key visible), by flash-attn.

    The keys have no batch dim (the prompt state), so the B batch rows are folded into the query
    sequence: one call over [1, B * R, X, D] queries and the chunk as a [1, C, K, D] view — no
    copy of the chunk per row (a copy of the queries to flash-attn's layout only). GQA (X a
    multiple of K) is flash-attn's own.
    """
    batch, heads, rows, dim = q_BXRD.shape
    q_1NXD = q_BXRD.permute(0, 2, 1, 3).reshape(1, batch * rows, heads, dim)
    out_1NXD, lse_1XN = installed("flash_attn").flash_attn_func(
        q_1NXD,
        k_CKD.unsqueeze(0),
        v_CKD.unsqueeze(0),
        dropout_p=0.0,
        softmax_scale=scale,
        causal=False,
        return_attn_probs=True,
    )[:2]
    out_BXRD = out_1NXD.view(batch, rows, heads, dim).permute(0, 2, 1, 3).float()
    # Some flash-attn 2 releases pad the lse's sequence dim to a multiple of 128: keep N rows.
    lse_BXR = lse_1XN[0, :, : batch * rows].reshape(heads, batch, rows).transpose(0, 1)
    return out_BXRD, lse_BXR.float()


# --- linear attention ----------------------------------------------------------------------------


def delta_rule_recompute_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel the blockwise backward recomputes a gated-delta-rule block on."""
    if (
        device.type == "cuda"
        and dtype in _FLA_DTYPES
        and os.environ.get(FLA_RECOMPUTE_ENV) == "1"
        and installed("fla") is not None
    ):
        return FLA
    return TORCH


def fla_chunk_gated_delta_rule():
    """fla's `chunk_gated_delta_rule` (q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV];
    `initial_state` [B, HV, K, V] fp32; returns (out, final state)): the signature of
    `ops.gated_delta_rule.chunked_gated_delta_rule` minus `chunk_size`."""
    return installed("fla").chunk_gated_delta_rule
