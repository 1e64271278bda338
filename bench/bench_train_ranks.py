"""`longstraw train` on 1 vs N ranks at one prompt length: step time and peak RSS per rank.

Each run is its own `longstraw train --no-prefect` process (the product's entry point; Prefect's
constant start-up is measured elsewhere) on the `small` qwen3_5 hybrid with the synthetic task;
a sampler polls the RSS of the driver and of every rank it starts. Runs alternate between the
world sizes (the machine is shared): ratios are taken within a round. Usage:

    .venv/bin/python bench/bench_train_ranks.py --prompt-len 16384 --rounds 1 \
        --out bench/results/train_ranks_16k.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

OMP_PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Idle OpenMP threads sleep instead of spinning (a spinning 2-thread process ran 3x slower)."""


def run_config(root: Path, prompt_len: int, world_size: int, args) -> dict:
    return {
        "run_id": f"ranks-{world_size}",
        "model": {"init_family": "qwen3_5", "init_size": "small", "dtype": "float32"},
        "engine": {"shard_tokens": args.shard_tokens, "prompt_grad": "exact"},
        "grpo": {
            "num_generations": args.group,
            "max_completion_length": args.completion,
            "learning_rate": 1e-5,
            "loss_type": "dapo",
        },
        "data": {
            "type": "haystack",
            "num_prompts": 1,
            "rewards": ["haystack_shaped"],
            "task": {"num_prompt_tokens": prompt_len, "value_alphabet": "0123456789"},
        },
        "train": {"num_steps": args.steps, "groups_per_step": 1, "checkpoint_every": 100},
        "storage": {"root_uri": str(root), "persist_mode": "background"},
        "parallel": {"world_size": world_size, "backend": "gloo"},
    }


def _sample(pid: int, peaks: dict[int, int], stop: threading.Event) -> None:
    """Peak RSS of `pid` and of each process below it (the ranks), by pid."""
    while not stop.is_set():
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                peaks[proc.pid] = max(peaks.get(proc.pid, 0), proc.memory_info().rss)
        stop.wait(0.1)


def one_run(prompt_len: int, world_size: int, args, root: Path) -> dict:
    wall, peaks, rows = train_process(root, run_config(root, prompt_len, world_size, args))
    return {
        "prompt_len": prompt_len,
        "world_size": world_size,
        "wall_s": wall,
        "step_s": [sum(r["seconds"].values()) for r in rows],
        "stage_s": [r["seconds"] for r in rows],
        "peak_rss_per_rank_bytes": peaks[:world_size],
        "loss": [r["loss"] for r in rows],
        "reward_mean": [r["reward_mean"] for r in rows],
        "load_avg": os.getloadavg(),
    }


def train_process(root: Path, config: dict, **env) -> tuple[float, list[int], list[dict]]:
    """(wall seconds, peak RSS of the driver then of each rank it started, metrics rows) of one
    `longstraw train --no-prefect` process on `config`, run under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    config_path = root / "run.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = {**os.environ, **OMP_PASSIVE, **env}
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "longstraw.cli", "train", "--config", str(config_path),
         "--no-prefect"],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    peaks: dict[int, int] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(process.pid, peaks, stop), daemon=True)
    sampler.start()
    out, _ = process.communicate()
    stop.set()
    sampler.join()
    wall = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(out.decode()[-3000:])
    metrics = root / "runs" / config["run_id"] / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    # The driver is rank 0; the rest are its spawned ranks (and their resource trackers, small).
    ranks = sorted(peaks.items(), key=lambda kv: kv[0] != process.pid)
    return wall, [rss for _, rss in ranks if rss > 200 * 2**20], rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=16384)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument("--shard-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="longstraw-bench-ranks-") as tmp:
        for round_ in range(args.rounds):
            for world in args.world_sizes:
                record = one_run(args.prompt_len, world, args, Path(tmp) / f"r{round_}-w{world}")
                record["round"] = round_
                results.append(record)
                print(json.dumps(record), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                    "runs": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
