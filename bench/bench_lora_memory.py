"""What LoRA adapters change in one `longstraw train` step: full-parameter against `model.lora`,
exact and detached, peak RSS, trainable parameters, optimizer bytes and step time side by side.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python bench/bench_lora_memory.py \
        --work <a folder outside the repository> [--prompt-tokens 32768] [--rank 16] \
        [--size small] [--out bench/results/lora_memory_32k.json]

Four runs of `longstraw train --no-prefect` on the same random-weight qwen3_5 checkpoint (`--size`,
built once under `--work`), the haystack task of exactly `--prompt-tokens` tokens, G = 8
completions of 16 tokens, 2048-token shards, one step, the state persisted to local Zarr:
{full-parameter, LoRA rank `--rank` on every linear layer} × {exact, detached}, each in its own
process computing its own prefill. Figures come from `bench_million_tokens.launch` (a 0.5 s RSS
sample of the train process: its peak, and the peak of each stage's window; `metrics.jsonl`: the
stage seconds and `trainable_parameters`) and the final checkpoint (`optimizer*.safetensors`
bytes: the AdamW state the run keeps). Ratios printed are LoRA / full of the same mode, from
this invocation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_million_tokens import add_step_arguments, init_model, launch, log, run_path, run_yaml

MODES = ("exact", "detached")


def optimizer_bytes(root: Path) -> int:
    """Bytes of the optimizer state in the run's latest checkpoint."""
    latest = sorted((run_path(root) / "checkpoints").glob("v*[0-9]"))[-1]
    return sum(p.stat().st_size for p in latest.glob("optimizer*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="run folders (never committed)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/lora_memory.json"))
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--size", choices=("tiny", "small"), default="small")
    add_step_arguments(parser, rss_cap_gib=12.0)
    args = parser.parse_args()
    args.work = args.work.resolve() / f"{args.size}-{args.prompt_tokens}"
    args.model_dir = args.work / "model"
    init_model(args.size, args.model_dir)
    lora = {"r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": "all-linear"}
    runs = {}
    for mode in MODES:
        for label, adapters in (("full", None), (f"lora-r{args.rank}", lora)):
            name = f"{label}-{mode}"
            root = args.work / name
            if root.exists():
                raise SystemExit(
                    f"{root} exists: remove it (or pick another --work) to measure again"
                )
            config = run_yaml(args, root, args.prompt_tokens, mode, None)
            if adapters is not None:
                config["model"]["lora"] = adapters
            record = launch(args, root, config, name)
            if record["outcome"] == "ok":
                metrics = record["metrics"]
                record["trainable_parameters"] = metrics["trainable_parameters"]
                record["optimizer_bytes"] = optimizer_bytes(root)
                record["step_seconds"] = sum(metrics["seconds"].values())
            runs[name] = record
    summary = {}
    for mode in MODES:
        full, adapted = runs.get(f"full-{mode}", {}), runs.get(f"lora-r{args.rank}-{mode}", {})
        if full.get("outcome") == adapted.get("outcome") == "ok":
            summary[mode] = {
                key: adapted[field] / full[field]
                for key, field in (
                    ("peak_rss_ratio", "peak_rss_sampled_bytes"),
                    ("trainable_ratio", "trainable_parameters"),
                    ("optimizer_bytes_ratio", "optimizer_bytes"),
                    ("step_time_ratio", "step_seconds"),
                )
            } | {
                "peak_rss_saved_bytes": full["peak_rss_sampled_bytes"]
                - adapted["peak_rss_sampled_bytes"]
            }
            log(f"{mode}: LoRA / full {json.dumps(summary[mode])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"args": meta, "runs": runs, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
