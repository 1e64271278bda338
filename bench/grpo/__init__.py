"""Benchmarks: LongStraw (exact / detached) against full-sequence GRPO, TRL and a plain forward.

Every configuration runs in its own process (`bench.grpo.worker`) under a time and a memory
cap enforced by the parent (`bench.grpo.runner`); a run that hits a cap is recorded with its
status, never dropped. Suites (`bench.grpo.suites`) write one JSON per run under
`bench/results/`, with ratios against baselines measured in the same run (the machine is shared).
"""
