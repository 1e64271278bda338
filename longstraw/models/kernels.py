"""The optional GPU kernels (the `gpu` extra) and what a run says when they are missing.

Without flash-linear-attention and causal-conv1d, transformers runs Gated DeltaNet and its short
convolution on its reference PyTorch code (correct, slower) and says so once per function: three
lines on every CPU run of a hybrid model. LongStraw says it once instead, at the start of a run
(`missing_kernels_line`), and `quiet_kernel_fallbacks` drops transformers' own lines — only
those, on the one logger that writes them.
"""

from __future__ import annotations

import importlib.util
import logging

GPU_KERNELS = {
    "flash_attn": "flash-attn",
    "fla": "flash-linear-attention",
    "causal_conv1d": "causal-conv1d",
}
"""Import name -> distribution of each package of the `gpu` extra (pyproject.toml)."""

_FALLBACK_LOGGER = "transformers.integrations.hub_kernels"
_FALLBACK_TEXT = "is falling back to its reference PyTorch implementation"


def missing_kernels() -> list[str]:
    """Distributions of the `gpu` extra that are not installed, in the extra's order."""
    return [
        dist for module, dist in GPU_KERNELS.items() if importlib.util.find_spec(module) is None
    ]


def missing_kernels_line() -> str | None:
    """One line naming the missing kernels and how to install them; None when all are there."""
    missing = missing_kernels()
    if not missing:
        return None
    return (
        f"kernels: pure PyTorch ({', '.join(missing)} not installed: correct, slower); "
        "on a GPU machine install them with pip install -e '.[gpu]'"
    )


class QuietKernelFallbacks(logging.Filter):
    """Drop transformers' "`<function>` is falling back to its reference PyTorch implementation
    ..." records; every other record of its logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _FALLBACK_TEXT not in record.getMessage()


def quiet_kernel_fallbacks() -> None:
    """Add the filter to the logger transformers' fallback lines come from (idempotent)."""
    logger = logging.getLogger(_FALLBACK_LOGGER)
    if not any(isinstance(f, QuietKernelFallbacks) for f in logger.filters):
        logger.addFilter(QuietKernelFallbacks())
