"""Long branches: segmented replay vs whole-branch replay vs full-sequence autograd.

One GRPO group (exact mode) of G branches of R tokens on a P-token prompt, `small` Qwen3.5
hybrid (fp32). Each configuration runs in a fresh subprocess, which reports the growth of its
peak resident set over the step (the high-water mark after the step minus the one after
loading the model and building the inputs) and the step's wall time. Printed as ratios against
whole-branch replay measured in the same run; JSON written to --out.

    .venv/bin/python bench/bench_segmented.py --prompt-tokens 4096 --branch-tokens 512,2048 \
        --segment-tokens 256 --out bench/results/segmented.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from longstraw.schemas.run import EngineConfig


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(args) -> None:
    import torch

    from longstraw.engine.group import accumulate_group_gradients
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.schemas.grpo import GRPOConfig

    torch.set_num_threads(2)
    model, _, _ = load_checkpoint(args.checkpoint, dtype=torch.float32)
    gen = torch.Generator().manual_seed(42)
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=gen)
    responses = [
        torch.randint(0, vocab, (args.branch_tokens,), generator=gen) for _ in range(args.group)
    ]
    advantages = torch.linspace(-1, 1, args.group)
    cfg = GRPOConfig(loss_type="grpo")
    base = _peak_rss()
    started = time.perf_counter()
    if args.mode == "full_sequence":
        for i, response in enumerate(responses):
            ids = torch.cat([prompt, response])[None]
            logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1]
            logp = logits.float().log_softmax(-1).gather(-1, response[:, None])[:, 0]
            (-(advantages[i] * logp.mean()) / args.group).backward()
            del logits, logp
    else:
        accumulate_group_gradients(
            model,
            prompt,
            responses,
            advantages,
            cfg,
            EngineConfig(
                shard_tokens=args.shard_tokens,
                prompt_grad="exact",
                branch_segment_tokens=args.segment_tokens if args.mode == "segmented" else None,
            ),
        )
    seconds = time.perf_counter() - started
    print(json.dumps({"peak_rss_growth": _peak_rss() - base, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--branch-tokens", default="512,2048")
    parser.add_argument("--segment-tokens", type=int, default=256)
    parser.add_argument("--shard-tokens", type=int, default=2048)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--modes", default="whole_branch,segmented,full_sequence")
    parser.add_argument("--out", default="bench/results/segmented.json")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--checkpoint")
    parser.add_argument("--branch-length", dest="branch_tokens_one", type=int)
    parser.add_argument("--mode")
    args = parser.parse_args()
    if args.worker:
        args.branch_tokens = args.branch_tokens_one
        _worker(args)
        return

    from longstraw.models.factory import init_model

    checkpoint = init_model("qwen3_5", "small", tempfile.mkdtemp(prefix="ls-seg-"), seed=42)
    rows = []
    for branch in [int(x) for x in args.branch_tokens.split(",")]:
        for mode in args.modes.split(","):
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                "--checkpoint",
                str(checkpoint),
                "--prompt-tokens",
                str(args.prompt_tokens),
                "--branch-length",
                str(branch),
                "--segment-tokens",
                str(args.segment_tokens),
                "--shard-tokens",
                str(args.shard_tokens),
                "--group",
                str(args.group),
                "--mode",
                mode,
            ]
            load = os.getloadavg()[0]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            row = {"branch_tokens": branch, "mode": mode, "load": load}
            row.update(json.loads(out.strip().splitlines()[-1]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    for branch in sorted({r["branch_tokens"] for r in rows}):
        base = next(
            (r for r in rows if r["branch_tokens"] == branch and r["mode"] == "whole_branch"), None
        )
        if base is None:  # no baseline measured at this length (--modes without whole_branch)
            continue
        for r in rows:
            if r["branch_tokens"] == branch:
                r["rss_ratio_vs_whole_branch"] = r["peak_rss_growth"] / max(
                    base["peak_rss_growth"], 1
                )
                r["time_ratio_vs_whole_branch"] = r["seconds"] / base["seconds"]
                print(
                    f"R={branch:6d} {r['mode']:>14s}: peak RSS growth "
                    f"{r['peak_rss_growth'] / 2**20:8.1f} MiB ({r['rss_ratio_vs_whole_branch']:.2f}x), "
                    f"step {r['seconds']:7.1f} s ({r['time_ratio_vs_whole_branch']:.2f}x)"
                )
    config = {
        k: getattr(args, k) for k in ("prompt_tokens", "segment_tokens", "shard_tokens", "group")
    }
    with open(args.out, "w") as f:
        json.dump({"config": config, "model": "qwen3_5 small fp32", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
