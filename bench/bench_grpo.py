"""LongStraw (exact / detached) vs full-sequence GRPO, TRL and a plain transformers forward.

A thin entry point: the suites live in `bench.grpo` (also `longstraw bench ...`).

    .venv/bin/python bench/bench_grpo.py context --prompt-lengths 4096,8192,16384,32768 --time-cap 600
    .venv/bin/python bench/bench_grpo.py group --prompt-tokens 32768 --group-sizes 2,4,8,16
    .venv/bin/python bench/bench_grpo.py prefill --prompt-tokens 32768
    .venv/bin/python bench/bench_grpo.py fidelity
    .venv/bin/python bench/bench_grpo.py plot && .venv/bin/python bench/bench_grpo.py report
"""

from bench.grpo.commands import bench_app

if __name__ == "__main__":
    bench_app()
