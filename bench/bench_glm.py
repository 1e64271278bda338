"""GLM-5 (glm_moe_dsa, `small` checkpoint) prefill and replay against transformers' forward.

    .venv/bin/python bench/bench_glm.py [--lengths 8192 16384] [--cap-s 300] [--out bench/results/glm.json]

Each configuration runs in its own subprocess (fresh peak RSS), with a wall-clock cap; a run that
exceeds it is recorded with status "timeout", not dropped.

- `longstraw`: `prefill(shard_tokens=2048)` of the prompt (no grad), then one branch replay of
  64 response tokens with autograd + backward (detached mode), both timed; peak RSS of the process.
- `transformers`: one forward over the whole prompt with its best settings for this: no grad,
  `logits_to_keep=1`, sdpa (it re-expands every latent into per-head K/V and builds [P, P] masks).

tokens/s = prompt tokens / seconds (replay: response tokens / seconds, forward + backward).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARD_TOKENS = 2048
RESPONSE_TOKENS = 64


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def worker(kind: str, checkpoint: str, length: int) -> dict:
    import torch

    from longstraw.models.checkpoint import load_checkpoint

    torch.set_num_threads(os.cpu_count() or 1)
    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    gen = torch.Generator().manual_seed(42)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (length,), generator=gen)
    loaded_rss = _peak_rss_gib()
    if kind == "transformers":
        model.config._attn_implementation = "sdpa"
        started = time.perf_counter()
        with torch.no_grad():
            model(prompt[None], logits_to_keep=1)
        seconds = time.perf_counter() - started
        return {
            "forward_s": seconds,
            "forward_tokens_per_s": length / seconds,
            "peak_rss_gib": _peak_rss_gib(),
            "loaded_rss_gib": loaded_rss,
        }
    from longstraw.engine.prefill import prefill
    from longstraw.engine.replay import branch_logprobs

    started = time.perf_counter()
    state = prefill(model, prompt, shard_tokens=SHARD_TOKENS)
    prefill_s = time.perf_counter() - started
    prefill_rss = _peak_rss_gib()
    response = torch.randint(0, vocab, (RESPONSE_TOKENS,), generator=gen)
    started = time.perf_counter()
    logp = branch_logprobs(model, state, response)
    logp.sum().backward()
    replay_s = time.perf_counter() - started
    return {
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": length / prefill_s,
        "prefill_peak_rss_gib": prefill_rss,
        "replay_s": replay_s,
        "replay_tokens_per_s": RESPONSE_TOKENS / replay_s,
        "peak_rss_gib": _peak_rss_gib(),
        "loaded_rss_gib": loaded_rss,
        "state_mib": state.state_bytes() / 2**20,
    }


def run_config(kind: str, checkpoint: str, length: int, cap_s: int) -> dict:
    command = [sys.executable, __file__, "--worker", kind, "--checkpoint", checkpoint]
    command += ["--length", str(length)]
    record = {"kind": kind, "prompt_tokens": length, "cap_s": cap_s}
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=cap_s)
    except subprocess.TimeoutExpired:
        record.update(status="timeout", wall_s=time.perf_counter() - started)
        return record
    record["wall_s"] = time.perf_counter() - started
    if done.returncode != 0:
        record.update(status=f"failed (exit {done.returncode})", stderr=done.stderr[-2000:])
        return record
    record.update(status="ok", **json.loads(done.stdout.strip().splitlines()[-1]))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--cap-s", type=int, default=300)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--out", default="bench/results/glm.json")
    parser.add_argument("--worker", default=None)
    parser.add_argument("--length", type=int, default=None)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.checkpoint, args.length)))
        return
    checkpoint = args.checkpoint
    if checkpoint is None:
        from longstraw.models.factory import init_model

        checkpoint = str(init_model("glm_moe_dsa", "small", Path(tempfile.mkdtemp()) / "glm-small"))
    results = []
    for length in args.lengths:
        for kind in ("longstraw", "transformers"):
            record = run_config(kind, checkpoint, length, args.cap_s)
            print(json.dumps(record), flush=True)
            results.append(record)
    out = {
        "benchmark": "glm_moe_dsa small: prefill + replay vs transformers forward",
        "shard_tokens": SHARD_TOKENS,
        "response_tokens": RESPONSE_TOKENS,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
