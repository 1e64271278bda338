"""What sweep checkpoints cost and what they save: exact mode's reverse sweep with and without
them, the bytes of each against the prompt state's, and a sweep resumed after a kill at 50 % and
at 90 % of its shards against the uninterrupted sweep.

    .venv/bin/python bench/bench_sweep_checkpoints.py [--prompt-len 131072] [--threads 2]
        [--seconds 600 [120 ...]] [--rounds 1] [--out bench/results/sweep_checkpoints.json]

On the `small` qwen3_5 hybrid (fp32, random weights), in one process: prefill a random prompt of
P tokens in 2048-token shards, then per round, in alternating order, one exact-mode group
gradient of G = 8 random 32-token responses without sweep checkpoints (A) and one with them at
each `engine.sweep_checkpoint_seconds` of `--seconds` (default the config's) under a local
storage root (B). While B runs, the sweep's directory is snapshotted (hard links: its files are
never written again) as a kill would leave it right after 50 % and 90 % of the shards were
swept — the latest committed checkpoint and any write in flight. Each snapshot is then resumed
as `--resume` resumes it (a fresh backward, the same storage calls; an empty snapshot, nothing
written yet, is the uninterrupted backward A and is not run again): the resumed backward's whole
time (reading the checkpoint back, the shards after it; no replay) is compared with
(1 − fraction) × A's sweep + one checkpoint interval (the longest between two commits of B, at
least the configured one: the 20 × rule of `training.sweep_checkpoints` may stretch it), and
its gradient with A's, bitwise.

Prints each figure with its ratio to A's sweep measured in the same round; writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import longstraw
from longstraw.engine.group import group_gradient, group_inputs
from longstraw.models.checkpoint import load_checkpoint
from longstraw.models.factory import init_model
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig, RunConfig
from longstraw.schemas.storage import SweepKey
from longstraw.storage.paths import sweep_dir_uri
from longstraw.training.sweep_checkpoints import StoredSweepCheckpoints, placement

SHARD_TOKENS = 2048
GROUP = 8
COMPLETION = 32
KILLS = (0.5, 0.9)


def _key(num_shards: int) -> SweepKey:
    digest = "0" * 64
    return SweepKey(
        run_id="bench", policy_version=0, weights_digest=digest, prompt_digest=digest,
        num_shards=num_shards, group=0, iteration=0, responses=digest, advantages=digest,
        loss_config=digest, engine=digest, model=digest, placement=placement(1, 1),
    )  # fmt: skip


def _config(root: Path, seconds: float | None) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run_id": "bench",
            "model": {"checkpoint": str(root / "unused")},
            "engine": {"shard_tokens": SHARD_TOKENS, "sweep_checkpoint_seconds": seconds},
            "storage": {"root_uri": str(root), "persist_mode": "synchronous"},
        }
    )


def _snapshot(source: Path, target: Path) -> None:
    """A kill's leftovers: the directory as it is now, by hard links (no file is rewritten)."""
    shutil.copytree(source, target, copy_function=os.link)


class Backward:
    """One group's gradient (replay + sweep) on the prefilled state, timed."""

    def __init__(self, model, state, prompt_len: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        vocab = model.config.get_text_config().vocab_size
        responses = [
            torch.randint(0, vocab, (COMPLETION,), generator=generator) for _ in range(GROUP)
        ]
        advantages = torch.randn(GROUP, generator=generator)
        self.model, self.state = model, state
        self.loss = GRPOConfig(loss_type="dapo", num_generations=GROUP)
        self.inputs = group_inputs(model, responses, advantages, self.loss, prompt_grad="exact")
        self.engine = EngineConfig(prompt_grad="exact", shard_tokens=SHARD_TOKENS)

    def run(self, checkpoints=None, on_shard=None) -> tuple[dict, dict[str, torch.Tensor]]:
        started = time.perf_counter()
        grads, stats = group_gradient(
            self.model, self.state, self.inputs, self.loss, self.engine,
            checkpoints=checkpoints, on_sweep_shard=on_shard,
        )  # fmt: skip
        row = {
            "backward_s": time.perf_counter() - started,
            "replay_s": stats.seconds.replay,
            "sweep_s": stats.seconds.sweep,
            "shards_computed": stats.sweep_shards_computed,
            "shards_resumed": stats.sweep_shards_resumed,
            "load_average": os.getloadavg()[0],
        }
        return row, {name: g.clone() for name, g in grads.grads.items()}


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a
    )


def checkpointed(backward: Backward, root: Path, seconds: float) -> tuple[dict, dict, dict]:
    """(B's row, its gradient, {fraction: snapshot dir}) of a sweep with checkpoints."""
    num_shards = backward.state.num_shards
    config = _config(root, seconds)
    sweep_dir = _sweep_dir(config)
    shutil.rmtree(sweep_dir, ignore_errors=True)
    checkpoints = StoredSweepCheckpoints(config, _key(num_shards))
    snapshots: dict[float, Path] = {}
    sweep_started: list[float] = []

    def snapshot_after(done: int, total: int, resumed: int) -> None:
        if not sweep_started:
            sweep_started.append(checkpoints.clock())
        for fraction in KILLS:
            if fraction not in snapshots and done >= math.ceil(fraction * total):
                target = snapshots[fraction] = root / f"killed-at-{fraction}-every-{seconds:g}"
                shutil.rmtree(target, ignore_errors=True)
                if sweep_dir.exists():
                    _snapshot(sweep_dir, target)
                else:
                    target.mkdir(parents=True)

    row, grads = backward.run(checkpoints, snapshot_after)
    row["checkpoint_seconds"] = seconds
    # The longest stretch of sweep a kill could lose: between two commits, or from the start.
    moments = sweep_started + checkpoints.committed_at
    row["longest_interval_s"] = max(
        (b - a for a, b in itertools.pairwise(moments)), default=row["sweep_s"]
    )
    row["checkpoints"] = [
        {"swept": s, "write_s": w, "bytes": b}
        for s, w, b in zip(
            checkpoints.committed, checkpoints.write_seconds, checkpoints.bytes_written,
            strict=True,
        )
    ]  # fmt: skip
    return row, grads, snapshots


def resumed(backward: Backward, root: Path, seconds: float, snapshot: Path) -> tuple[dict, dict]:
    """A kill's leftovers (`snapshot`) resumed as `--resume` resumes them."""
    config = _config(root, seconds)
    sweep_dir = _sweep_dir(config)
    shutil.rmtree(sweep_dir, ignore_errors=True)
    _snapshot(snapshot, sweep_dir)
    row, grads = backward.run(StoredSweepCheckpoints(config, _key(backward.state.num_shards)))
    shutil.rmtree(sweep_dir, ignore_errors=True)
    return row, grads


def _sweep_dir(config: RunConfig) -> Path:
    return Path(sweep_dir_uri(config.storage, "bench", 0, 0).removeprefix("file://"))


def one_round(backward: Backward, root: Path, cadences: list[float], reverse: bool) -> dict:
    """A (no checkpoints) and B at each cadence, in this order or its reverse; then each B's
    kills resumed."""
    runs = ["A", *cadences]
    out: dict = {"order": [str(r) for r in (runs[::-1] if reverse else runs)], "B": []}
    grads, snapshots = {}, {}
    for which in runs[::-1] if reverse else runs:
        if which == "A":
            out["A"], grads["A"] = backward.run()
        else:
            row, grads[which], snapshots[which] = checkpointed(backward, root, which)
            out["B"].append(row)
    for row in out["B"]:
        seconds = row["checkpoint_seconds"]
        row["bitwise_equal_to_A"] = _same_bits(grads[seconds], grads["A"])
        row["killed"] = {}
        for fraction, snap in snapshots[seconds].items():
            if not any(snap.iterdir()):
                # Nothing committed before the kill: the resumed backward is the uninterrupted
                # one (replay and every shard), A's run; not run again.
                kill = {**out["A"], "shards_resumed": 0, "as_A": True, "bitwise_equal_to_A": True}
            else:
                kill, kill_grads = resumed(backward, root, seconds, snap)
                kill["bitwise_equal_to_A"] = _same_bits(kill_grads, grads["A"])
            # One checkpoint interval: the longest this run had, at least the configured one.
            interval = max(seconds, row["longest_interval_s"]) if row["checkpoints"] else seconds
            kill["target_s"] = (1 - fraction) * out["A"]["sweep_s"] + interval
            row["killed"][str(fraction)] = kill
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=131072)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--seconds", type=float, nargs="+", default=[EngineConfig().sweep_checkpoint_seconds],
        help="engine.sweep_checkpoint_seconds, one checkpointed run each (default: the "
        "config's default)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--size", default="small", help="init_model size (tiny: a quick check)")
    parser.add_argument("--root", type=Path, default=None, help="storage root (a temp dir)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or Path(tmp) / "root"
        model, _, _ = load_checkpoint(init_model("qwen3_5", args.size, Path(tmp) / args.size))
        generator = torch.Generator().manual_seed(42)
        vocab = model.config.get_text_config().vocab_size
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=generator)
        started = time.perf_counter()
        state = longstraw.prefill(model, prompt, shard_tokens=SHARD_TOKENS)
        prefill_s = time.perf_counter() - started
        state_bytes = state.state_bytes() + state.checkpoint_bytes()
        print(
            f"P={args.prompt_len}: {state.num_shards} shards, prompt state "
            f"{state_bytes / 2**20:.0f} MiB, prefill {prefill_s:.0f} s; checkpoints every "
            f"{', '.join(f'{s:g}' for s in args.seconds)} s",
            flush=True,
        )
        backward = Backward(model, state, args.prompt_len, seed=43)
        rounds = []
        for r in range(args.rounds):
            rounds.append(one_round(backward, root, args.seconds, reverse=r % 2 == 1))
            _print_round(r, rounds[-1], state_bytes)
            if args.out is not None:  # after every round: a long run keeps what it measured
                record = {
                    "prompt_len": args.prompt_len,
                    "threads": args.threads,
                    "model": f"qwen3_5 {args.size}",
                    "shards": state.num_shards,
                    "shard_tokens": SHARD_TOKENS,
                    "checkpoint_seconds": args.seconds,
                    "prefill_s": prefill_s,
                    "prompt_state_bytes": state_bytes,
                    "rounds": rounds,
                }
                args.out.write_text(json.dumps(record, indent=2) + "\n")


def _print_round(r: int, row: dict, state_bytes: int) -> None:
    a = row["A"]
    print(
        f"round {r} ({', '.join(row['order'])}): sweep without checkpoints {a['sweep_s']:.0f} s "
        f"(load {a['load_average']:.1f})",
        flush=True,
    )
    for b in row["B"]:
        writes = sum(c["write_s"] for c in b["checkpoints"])
        print(
            f"  every {b['checkpoint_seconds']:g} s: sweep {b['sweep_s']:.0f} s = "
            f"{b['sweep_s'] / a['sweep_s']:.3f} x (load {b['load_average']:.1f}); "
            f"{len(b['checkpoints'])} checkpoints written in {writes:.1f} s "
            f"({100 * writes / b['sweep_s']:.2f} % of its sweep; longest interval "
            f"{b['longest_interval_s']:.0f} s), bitwise {b['bitwise_equal_to_A']}",
            flush=True,
        )
        for c in b["checkpoints"]:
            print(
                f"    after {c['swept']} shards: {c['bytes'] / 2**20:.0f} MiB "
                f"({c['bytes'] / state_bytes:.2f} x the prompt state), written in "
                f"{c['write_s']:.1f} s",
                flush=True,
            )
        for fraction, k in b["killed"].items():
            print(
                f"    killed at {100 * float(fraction):.0f} %: resumed backward "
                f"{k['backward_s']:.0f} s ({k['shards_resumed']} shards taken) = "
                f"{k['backward_s'] / a['sweep_s']:.3f} x the uninterrupted sweep"
                f"{' (no checkpoint yet: the uninterrupted backward, A)' if k.get('as_A') else ''}"
                f"; target <= "
                f"{k['target_s']:.0f} s ({k['target_s'] / a['sweep_s']:.3f} x); bitwise "
                f"{k['bitwise_equal_to_A']}",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
