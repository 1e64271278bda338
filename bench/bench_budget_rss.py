"""What `engine.state_budget_bytes` does to the whole process: one `longstraw train` step with the
prompt state resident, then with a budget of 0 on the disk tier, peak RSS side by side.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python bench/bench_budget_rss.py \
        --work <a folder outside the repository> [--prompt-tokens 131072] [--mode detached] \
        [--size small] [--out bench/results/budget_rss.json]

Both runs are `longstraw train --no-prefect` on the same random-weight qwen3_5 checkpoint
(`--size`, built once under `--work`), the haystack task of exactly `--prompt-tokens` tokens,
G = 8 completions of 16 tokens, 2048-token shards, one step, the state persisted to local Zarr;
each computes its own prefill (the budgeted one writes each shard's rows straight to its scratch
file). Figures come from `bench_million_tokens.launch`: a 0.5 s RSS sample of the train process
(peak, and per stage), `metrics.jsonl` (seconds per stage, the tiered store's peak and traffic),
the state's bytes on disk, and the final checkpoint's sha256 — the budgeted run's must be the
resident run's. The ratio printed is budgeted / resident peak RSS, both from this invocation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_million_tokens import add_step_arguments, init_model, launch, log, run_yaml


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="run folders (never committed)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/budget_rss.json"))
    parser.add_argument("--prompt-tokens", type=int, default=131072)
    parser.add_argument("--mode", choices=("detached", "exact"), default="detached")
    parser.add_argument("--size", choices=("tiny", "small"), default="small")
    add_step_arguments(parser, rss_cap_gib=12.0)
    args = parser.parse_args()
    args.work = args.work.resolve() / f"{args.size}-{args.prompt_tokens}-{args.mode}"
    model = args.work / "model"
    init_model(args.size, model)
    runs = {}
    for label, budget in (("resident", None), ("budget-0-disk", 0)):
        root = args.work / label
        if root.exists():
            raise SystemExit(f"{root} exists: remove it (or pick another --work) to measure again")
        config = run_yaml(args, root, args.prompt_tokens, args.mode, budget)
        runs[label] = launch(args, root, config, label) | {"budget_bytes": budget}
        if runs[label]["outcome"] != "ok":
            break
    resident, budgeted = runs.get("resident", {}), runs.get("budget-0-disk", {})
    summary = {}
    if resident.get("outcome") == budgeted.get("outcome") == "ok":
        summary = {
            "peak_rss_ratio_budget_over_resident": budgeted["peak_rss_sampled_bytes"]
            / resident["peak_rss_sampled_bytes"],
            "peak_rss_saved_bytes": resident["peak_rss_sampled_bytes"]
            - budgeted["peak_rss_sampled_bytes"],
            "state_bytes_on_disk": resident["state_bytes_on_disk"],
            "checkpoint_equal_to_resident": budgeted["checkpoint_sha256"]
            == resident["checkpoint_sha256"],
            "step_time_ratio_budget_over_resident": budgeted["wall_s"] / resident["wall_s"],
        }
        log(
            f"peak RSS {resident['peak_rss_sampled_bytes'] / 2**30:.2f} GiB resident, "
            f"{budgeted['peak_rss_sampled_bytes'] / 2**30:.2f} GiB under a budget of 0 "
            f"(x{summary['peak_rss_ratio_budget_over_resident']:.2f}); state "
            f"{summary['state_bytes_on_disk'] / 2**20:.0f} MiB; checkpoints equal: "
            f"{summary['checkpoint_equal_to_resident']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"args": meta, "runs": runs, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
