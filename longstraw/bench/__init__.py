"""Benchmarks: LongStraw (exact / detached) against full-sequence GRPO, TRL and a plain forward.

Every configuration runs in its own process (`longstraw.bench.worker`) under a time and a memory
cap enforced by the parent (`longstraw.bench.runner`); a run that hits a cap is recorded with its
status, never dropped. Suites (`longstraw.bench.suites`) write one JSON per run under
`bench/results/`, with ratios against baselines measured in the same run (the machine is shared).
"""
