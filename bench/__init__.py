"""LongStraw's benchmarks: one script per question (`bench/bench_*.py`, `bench/gpu_selfcheck.py`),
run from a checkout, and the GRPO method-comparison suites (`bench.grpo`, mounted as
`longstraw bench`). Results go under `bench/results/`; docs/benchmarks.md records the latest ones
with their commands.
"""
