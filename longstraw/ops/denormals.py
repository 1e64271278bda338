"""Flush subnormal floats to zero while a float64 backward runs on the CPU.

Gated DeltaNet's decays are exp of segment sums of log-decays that reach -30 per token in
random-weight (and some trained) heads; across a 64-token chunk the products of such decays
fall below 2.2e-308, where float64 turns subnormal. x86 takes a microcode assist for every
operation on a subnormal operand or result: with a few thousand subnormal entries in a block's
UT transform, one 256-token block of the float64 delta-rule backward took 35 ms, against 25 ms
with subnormals flushed (`bench/bench_sweep.py`, the `small` qwen3_5 hybrid, one thread).

Flushing (FTZ/DAZ) replaces values below 2.2e-308 by zero. What the backward returns is rounded
to fp32 (or a narrower dtype), whose smallest value is 1.4e-45: a change of 1e-308 cannot reach
it. The forward kernels never run inside: their bits, which the sweep's state check compares,
are unchanged.

The mode is a property of the CPU thread: `torch.set_flush_denormal` sets it on the calling
thread only, not on the OpenMP workers of an intra-op thread pool, which keep computing
subnormals (at two threads, about half of the work).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# The smallest positive subnormal double's neighbourhood: reads as zero once flushing is on.
_SUBNORMAL = 1e-310


def denormals_flushed_now() -> bool:
    """Whether the calling thread flushes subnormals (torch has no getter: probe one)."""
    return (torch.full((), _SUBNORMAL, dtype=torch.float64) * 1.0).item() == 0.0


@contextlib.contextmanager
def denormals_flushed() -> Iterator[None]:
    """Inside the block the calling thread flushes subnormals to zero (where the CPU supports
    it); the mode it had is restored on exit."""
    before = denormals_flushed_now()
    if before or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
