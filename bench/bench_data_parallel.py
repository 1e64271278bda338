"""A step of 4 groups on one process vs two data-parallel replicas: step time and peak RSS per
rank, and the bytes the replicas' gradient sum moves against the gradient's size.

Each run is its own `longstraw train --no-prefect` process on the `small` qwen3_5 hybrid with the
synthetic task, one intra-op thread per rank (`OMP_NUM_THREADS=1`), so the two replicas of one
rank each use the machine's two cores and one process uses one: the ideal step ratio is 0.5.
The step time is the metrics' `step_seconds` of the steps after the first (the first loads and
warms up). A sampler polls the RSS of the driver and of every rank it starts. Runs alternate
(the machine is shared): ratios are taken within a round. Usage:

    .venv/bin/python bench/bench_data_parallel.py --prompt-len 4096 --rounds 2 \
        --out bench/results/data_parallel.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_ranks import run_config as train_ranks_config
from bench_train_ranks import train_process


def run_config(root: Path, replicas: int, args) -> dict:
    """`bench_train_ranks`'s run on `replicas` replicas of one rank, `args.groups` prompts a
    step drawn from a stream of 64."""
    config = train_ranks_config(root, args.prompt_len, replicas, args)
    config["run_id"] = f"replicas-{replicas}"
    config["data"]["num_prompts"] = 64
    config["train"]["groups_per_step"] = args.groups
    config["parallel"]["data_parallel"] = replicas
    return config


def gradient_bytes(args) -> int:
    """fp32 bytes of the policy's gradient (every trainable parameter)."""
    from longstraw.models.factory import init_model

    with tempfile.TemporaryDirectory() as tmp:
        from longstraw.models.checkpoint import load_checkpoint

        model, _, _ = load_checkpoint(init_model("qwen3_5", "small", Path(tmp) / "m"))
        return 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def one_run(replicas: int, args, root: Path) -> dict:
    wall, peaks, rows = train_process(root, run_config(root, replicas, args), OMP_NUM_THREADS="1")
    return {
        "replicas": replicas,
        "wall_s": wall,
        "step_s": [r["step_seconds"] for r in rows],
        "stage_s": [r["seconds"] for r in rows],
        "peak_rss_per_rank_bytes": peaks[:replicas],
        "loss": [r["loss"] for r in rows],
        "reward_mean": [r["reward_mean"] for r in rows],
        "replica_sum_bytes": [r["replica_sum_bytes"] for r in rows],
        "load_avg": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--completion", type=int, default=16)
    parser.add_argument("--shard-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="longstraw-bench-dp-") as tmp:
        for round_ in range(args.rounds):
            for replicas in (1, 2):
                record = one_run(replicas, args, Path(tmp) / f"r{round_}-d{replicas}")
                record["round"] = round_
                results.append(record)
                print(json.dumps(record), flush=True)
    ratios = []
    for round_ in range(args.rounds):
        one, two = (r for r in results if r["round"] == round_)
        ratios.append(statistics.median(two["step_s"][1:]) / statistics.median(one["step_s"][1:]))
    summary = {
        "step_ratio_2_over_1": ratios,
        "gradient_bytes": gradient_bytes(args),
    }
    print(json.dumps(summary), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                    "summary": summary, "runs": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
