"""Exact mode's reverse sweep against the prefill of the same prompt, in one process.

    .venv/bin/python bench/bench_sweep.py [--prompt-len 8192] [--threads 1] [--repeats 1]

On the `small` qwen3_5 hybrid (fp32, random weights, built under a temporary folder through the
checkpoint path a user's takes): prefill a random prompt of P tokens in 2048-token shards, then
one exact-mode group gradient of G = 8 random 32-token responses (`accumulate_group_gradients`,
`loss_type: dapo`). Prints, per repeat, the prefill, replay and sweep seconds and the sweep as a
multiple of the prefill of the same prompt (measured in the same process, so a load shared by
both moves both), and how often transformers' delta-rule kernel and the prefix attention's
forward ran during the sweep's backward (activation checkpointing's recompute of each layer),
and the process's peak RSS.
Writes JSON (`--out`).

Before / after a change: run it from a checkout of each commit (`PYTHONPATH=<checkout>`),
alternated.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

import longstraw
from longstraw.engine import sweep
from longstraw.models.checkpoint import load_checkpoint
from longstraw.models.factory import init_model
from longstraw.ops import prefix_attention
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig

SHARD_TOKENS = 2048
GROUP = 8
COMPLETION = 32


def _counting_calls_in_backward() -> dict[str, int]:
    """Count the delta-rule kernel's and the prefix attention's forwards while a sweep shard's
    backward runs."""
    calls = {"delta_rule": 0, "attention": 0}

    def counting(name, function):
        def counted(*args, **kwargs):
            calls[name] += bool(sweep._LAYER_RECOMPUTE_SKIPS_MLP[0])
            return function(*args, **kwargs)

        return counted

    kernel = modeling_qwen3_5.torch_chunk_gated_delta_rule
    modeling_qwen3_5.torch_chunk_gated_delta_rule = counting("delta_rule", kernel)
    # Before the change that split it out, the attention's forward ran inside its autograd
    # Function; count that then.
    if hasattr(prefix_attention, "_attention_outputs"):
        forward = prefix_attention._attention_outputs
        prefix_attention._attention_outputs = counting("attention", forward)
    else:
        forward = prefix_attention._PrefixCachedAttention.forward
        prefix_attention._PrefixCachedAttention.forward = staticmethod(
            counting("attention", forward)
        )
    return calls


def run(prompt_len: int, seed: int, model) -> dict:
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=generator)
    responses = [torch.randint(0, vocab, (COMPLETION,), generator=generator) for _ in range(GROUP)]
    advantages = torch.randn(GROUP, generator=generator)
    calls = _counting_calls_in_backward()
    started = time.perf_counter()
    state = longstraw.prefill(model, prompt, shard_tokens=SHARD_TOKENS)
    prefill_s = time.perf_counter() - started
    stats = longstraw.accumulate_group_gradients(
        model,
        state,
        responses,
        advantages,
        GRPOConfig(loss_type="dapo", num_generations=GROUP),
        EngineConfig(prompt_grad="exact", shard_tokens=SHARD_TOKENS),
    )
    model.zero_grad(set_to_none=True)
    return {
        "prefill_s": prefill_s,
        "replay_s": stats.seconds.replay,
        "sweep_s": stats.seconds.sweep,
        "sweep_over_prefill": stats.seconds.sweep / prefill_s,
        "delta_rule_calls_in_backward": calls["delta_rule"],
        "attention_forwards_in_backward": calls["attention"],
        "load_average": os.getloadavg()[0],
        # The process's peak so far (KiB on Linux): the sweep's, in exact mode, after the first.
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model, _, _ = load_checkpoint(init_model("qwen3_5", "small", Path(tmp) / "small"))
    rows = []
    for repeat in range(args.repeats):
        row = run(args.prompt_len, 42 + repeat, model)
        rows.append(row)
        print(
            f"P={args.prompt_len} threads={args.threads}: prefill {row['prefill_s']:.1f} s, "
            f"replay {row['replay_s']:.1f} s, sweep {row['sweep_s']:.1f} s = "
            f"{row['sweep_over_prefill']:.2f} x prefill; in the sweep's backward "
            f"{row['delta_rule_calls_in_backward']} delta-rule and "
            f"{row['attention_forwards_in_backward']} attention forwards "
            f"(load {row['load_average']:.1f}); peak RSS {row['peak_rss_mib']:.0f} MiB",
            flush=True,
        )
    if args.out is not None:
        record = {"prompt_len": args.prompt_len, "threads": args.threads, "runs": rows}
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
