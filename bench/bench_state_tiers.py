"""Exact-mode group step with the prompt state resident vs under a budget, the rest on local disk.

    .venv/bin/python bench/bench_state_tiers.py [--length 8192] [--group 8] [--budget-mib 4]
        [--repeats 1] [--timing-repeats 0] [--threads <cpus>] [--out bench/results/state_tiers.json]

`small` Qwen3.5 hybrid, fp32, exact mode, 2048-token shards, G responses of 32 tokens. Each
configuration runs in its own subprocess. The prefill runs first, resident in both; then the
peak RSS is reset (`/proc/self/clear_refs`), and the step (replay of every branch + the reverse
sweep) is timed and its peak RSS above the floor (RSS at the reset, minus the state and its
cotangent where those moved to disk) recorded. With `--repeats N` the two configurations
alternate N times (resident, tiered, resident, ...), so a change of machine load hits both;
ratios are tiered / resident of the fastest run of each (`summary`). `--timing-repeats K` adds
step times from one more subprocess that prefills once and alternates the two K times
(`timing_worker`: no RSS figures, but the same process and state for both).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from longstraw.schemas.run import EngineConfig

SHARD_TOKENS = 2048
RESPONSE_TOKENS = 32


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _prefilled(checkpoint: str, length: int, group: int, threads: int):
    """The model, G random responses, advantages and the prefilled state of a random prompt."""
    import torch

    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint

    torch.set_num_threads(threads)
    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    gen = torch.Generator().manual_seed(42)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (length,), generator=gen)
    responses = [torch.randint(0, vocab, (RESPONSE_TOKENS,), generator=gen) for _ in range(group)]
    advantages = torch.linspace(-1, 1, group)
    return model, responses, advantages, prefill(model, prompt, shard_tokens=SHARD_TOKENS)


def worker(
    checkpoint: str, length: int, group: int, budget: int | None, scratch: str, threads: int
) -> dict:

    from longstraw.engine.group import accumulate_group_gradients
    from longstraw.engine.state_tiers import tier_state
    from longstraw.schemas.grpo import GRPOConfig

    model, responses, advantages, state = _prefilled(checkpoint, length, group, threads)
    state_bytes = state.state_bytes()
    tiered = None
    if budget is not None:
        tiered = tier_state(model, state, budget_bytes=budget, lower="disk", directory=scratch)
        state = tiered.state
    # The floor: model, prefill leftovers; from here on only the step's own memory counts.
    Path("/proc/self/clear_refs").write_text("5")
    floor_kib = _status_kib("VmRSS")
    started = time.perf_counter()
    stats = accumulate_group_gradients(
        model, state, responses, advantages, GRPOConfig(), EngineConfig(shard_tokens=SHARD_TOKENS)
    )
    seconds = time.perf_counter() - started
    peak_kib = _status_kib("VmHWM")
    record = {
        "budget_bytes": budget,
        "load_avg_1m": os.getloadavg()[0],
        "step_s": seconds,
        "replay_s": stats.seconds.replay,
        "sweep_s": stats.seconds.sweep,
        "floor_mib": floor_kib / 1024,
        "peak_above_floor_mib": (peak_kib - floor_kib) / 1024,
        "state_mib": state_bytes / 2**20,
        "cotangent_mib": stats.cotangent_bytes / 2**20,
        "loss": stats.loss,
    }
    if tiered is not None:
        store = tiered.store
        record.update(
            peak_resident_mib=store.peak_resident_bytes / 2**20,
            layer_mib=max(store.unit_bytes.values()) / 2**20,
            chunk_tokens=store.chunk_tokens,
            chunk_unit_mib=store.chunk_unit_bytes / 2**20,
            permanent_layers=len(store.permanent),
            read_mib=store.bytes_read / 2**20,
            written_mib=store.bytes_written / 2**20,
        )
        tiered.close()
    return record


def timing_worker(
    checkpoint: str, length: int, group: int, budget: int, scratch: str, repeats: int, threads: int
) -> list[dict]:
    """Step times only, one process, one prefill: resident and tiered alternate `repeats` times
    (same model, same state, same load as far as the machine allows)."""

    from longstraw.engine.group import accumulate_group_gradients
    from longstraw.engine.state_tiers import tier_state
    from longstraw.schemas.grpo import GRPOConfig

    model, responses, advantages, state = _prefilled(checkpoint, length, group, threads)
    records = []
    for _ in range(repeats):
        for label in ("resident", "tiered"):
            tiered = None
            if label == "tiered":
                tiered = tier_state(
                    model, state, budget_bytes=budget, lower="disk", directory=scratch
                )
            load = os.getloadavg()[0]
            started = time.perf_counter()
            stats = accumulate_group_gradients(
                model,
                state if tiered is None else tiered.state,
                responses,
                advantages,
                GRPOConfig(),
                EngineConfig(shard_tokens=SHARD_TOKENS),
            )
            records.append(
                {
                    "config": label,
                    "load_avg_1m": load,
                    "step_s": time.perf_counter() - started,
                    "replay_s": stats.seconds.replay,
                    "sweep_s": stats.seconds.sweep,
                }
            )
            if tiered is not None:
                tiered.close()
    return records


def run_config(args, budget: int | None) -> dict:
    command = [
        sys.executable, __file__, "--worker", "--checkpoint", args.checkpoint,
        "--length", str(args.length), "--group", str(args.group), "--scratch", args.scratch,
        "--threads", str(args.threads),
    ]  # fmt: skip
    if budget is not None:
        command += ["--budget", str(budget)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"budget_bytes": budget, "status": "error", "stderr": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(runs: dict[str, list[dict]]) -> dict[str, float]:
    """Tiered / resident of the fastest run of each (the one least slowed by other load) and of
    the smallest peak above the floor."""
    best = {}
    for label, records in runs.items():
        done = [r for r in records if "step_s" in r]
        if not done:
            return {}
        best[label] = (
            min(r["step_s"] for r in done),
            min(r["peak_above_floor_mib"] for r in done),
        )
    return {
        "step_time": best["tiered"][0] / best["resident"][0],
        "peak_above_floor": best["tiered"][1] / best["resident"][1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--budget-mib", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timing-repeats", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--worker-timing", action="store_true")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--scratch", default=None)
    parser.add_argument("--out", default="bench/results/state_tiers.json")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--budget", type=int, default=None)
    args = parser.parse_args()
    if args.worker_timing:
        records = timing_worker(
            args.checkpoint,
            args.length,
            args.group,
            args.budget,
            args.scratch,
            args.timing_repeats,
            args.threads,
        )
        print(json.dumps(records))
        return
    if args.worker:
        print(
            json.dumps(
                worker(
                    args.checkpoint,
                    args.length,
                    args.group,
                    args.budget,
                    args.scratch,
                    args.threads,
                )
            )
        )
        return
    if args.checkpoint is None:
        from longstraw.models.factory import init_model

        args.checkpoint = str(init_model("qwen3_5", "small", Path(tempfile.mkdtemp()) / "q-small"))
    if args.scratch is None:
        args.scratch = tempfile.mkdtemp(prefix="longstraw-tiers-")
    budget = int(args.budget_mib * 2**20)
    runs = {"resident": [], "tiered": []}
    for _ in range(args.repeats):
        for label, value in (("resident", None), ("tiered", budget)):
            runs[label].append(run_config(args, value))
            print(json.dumps(runs[label][-1]), flush=True)

    ratios = summary(runs)
    timing = []
    if args.timing_repeats:
        command = [
            sys.executable, __file__, "--worker-timing", "--checkpoint", args.checkpoint,
            "--length", str(args.length), "--group", str(args.group), "--scratch", args.scratch,
            "--budget", str(budget), "--timing-repeats", str(args.timing_repeats),
            "--threads", str(args.threads),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            timing = [{"status": "error", "stderr": done.stderr[-2000:]}]
        else:
            timing = json.loads(done.stdout.strip().splitlines()[-1])
            best = {c: min(r["step_s"] for r in timing if r["config"] == c) for c in runs}
            ratios["step_time_one_process"] = best["tiered"] / best["resident"]
        print(json.dumps(timing), flush=True)
    out = {
        "benchmark": "qwen3_5 small, exact mode: state resident vs budget + local-disk tier",
        "length": args.length,
        "group": args.group,
        "shard_tokens": SHARD_TOKENS,
        "response_tokens": RESPONSE_TOKENS,
        "budget_bytes": budget,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "threads": args.threads,
        "repeats": args.repeats,
        "results": runs["resident"] + runs["tiered"],
        "ratios_tiered_over_resident": ratios,
        "timing_one_process": timing,
    }
    print(json.dumps(out["ratios_tiered_over_resident"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
