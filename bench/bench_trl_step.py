"""One real TRL `GRPOTrainer.train()` step against one `longstraw train` step, same workload.

    .venv/bin/python bench/bench_trl_step.py --family qwen3_5 --prompt-len 8192 --rounds 2 \
        --out bench/results/trl_step_qwen3_5_8k.json

Both systems start from the same checkpoint (`init_model(family, size)`, fp32, random weights,
written once under a temporary folder), the same P prompt token ids (random, seeded), G
completions of R tokens sampled by each system itself, and the same reward (a deterministic
function of the completion's text, `reward` below). Each step runs in its own process, the
systems alternated round by round (TRL first in odd rounds, LongStraw first in even ones), with
`OMP_NUM_THREADS` threads and passive OpenMP waits; the load average is recorded before and
after each process.

- TRL (`trl>=1.16,<1.17`, the `bench` extra): `GRPOTrainer(...).train()` for `max_steps=1`,
  `per_device_train_batch_size = num_generations = G`, gradient checkpointing on, TRL's
  defaults otherwise (`loss_type` dapo, beta 0). All G rows go through one batch: TRL's own
  generation (G copies of the prompt through `generate`, `min_new_tokens = R`) and its
  training forward and backward over G x (P + R) tokens. Its tokenizer is bypassed only so that
  both systems see the same prompt ids (`_tokenize_prompts` returns them). Phases: the step
  (trainer callbacks `on_step_begin` .. `on_step_end`, optimizer step included), of which
  generation and scoring (`_generate_and_score_completions`); the rest is the train part.
- LongStraw: `longstraw train --no-prefect` on a JSONL prompt dataset holding the same
  `prompt_ids`, exact prompt gradient, `engine.shard_tokens` 2048, one step of one group, no
  persistence (`storage.persist_mode: off`). Phases from its `metrics.jsonl`: generation =
  prefill + rollout + reward, train = replay + sweep + update; the final checkpoint's write is
  left out of the step (TRL saves nothing).

Whole step and peak RSS (the child's `ru_maxrss`, model load included) per system; the JSON
holds every run and the ratios TRL / LongStraw per round and of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

GROUP = 8
COMPLETION = 32
SHARD_TOKENS = 2048
SEED = 42

REWARD_SOURCE = '''
def reward(prompt, response, metadata=None):
    """A deterministic score of the completion's text in [0, 1] (varies across a group, so the
    advantages are not all zero)."""
    return (sum(map(ord, response)) % 11) / 10.0
'''
"""The one reward both systems score with: written next to the run config as `step_reward.py`
(LongStraw's `data.rewards: [step_reward:reward]`; TRL's reward function calls it)."""

GENERATION_STAGES = ("prefill", "rollout", "reward")
"""LongStraw's stages that TRL's `_generate_and_score_completions` does (prompt, sampling,
rewards); the others (replay, sweep, update) are the train part."""
LEFT_OUT_STAGES = ("checkpoint",)
"""Writing the checkpoint after the run's last step: TRL runs with `save_strategy="no"`."""

OMP_PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Idle OpenMP threads sleep instead of spinning (a spinning 2-thread process ran 3x slower)."""


def prepare(root: Path, family: str, size: str, prompt_len: int, vocab_cap: int | None) -> dict:
    """The checkpoint, the prompt ids and the reward module, under `root`."""
    import torch

    from longstraw.models.factory import init_model

    checkpoint = init_model(family, size, root / f"{family}-{size}")
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    generator = torch.Generator().manual_seed(SEED)
    # Token ids below the special ones: any id the tokenizer would not treat as text is avoided.
    high = min(vocab, vocab_cap) if vocab_cap else vocab
    prompt_ids = torch.randint(4, high - 4, (prompt_len,), generator=generator).tolist()
    (root / "step_reward.py").write_text(REWARD_SOURCE)
    (root / "prompts.jsonl").write_text(json.dumps({"id": "p0", "prompt_ids": prompt_ids}) + "\n")
    return {"checkpoint": str(checkpoint), "prompt_ids": prompt_ids}


# --- TRL -----------------------------------------------------------------------------------------


def trl_worker(root: Path, checkpoint: str, prompt_len: int, args) -> dict:
    import resource

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(root))
    from step_reward import reward  # written by `prepare`

    torch.set_num_threads(args.threads)
    prompt_ids = json.loads((root / "prompts.jsonl").read_text())["prompt_ids"]
    assert len(prompt_ids) == prompt_len
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)

    def rewards(completions, **_):
        return [reward("", text) for text in completions]

    trl_args = GRPOConfig(
        output_dir=str(root / "trl-out"),
        max_steps=1,
        per_device_train_batch_size=args.group,
        num_generations=args.group,
        max_completion_length=args.completion,
        generation_kwargs={"min_new_tokens": args.completion},
        gradient_checkpointing=True,
        learning_rate=1e-5,
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_strategy="no",
        save_strategy="no",
        seed=SEED,
    )
    dataset = Dataset.from_dict({"prompt": ["(the prompt ids are set below)"] * args.group})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=trl_args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    # The same prompt ids as LongStraw's: TRL tokenizes its dataset's text prompts; hand it the ids.
    trainer._tokenize_prompts = lambda prompts: ([list(prompt_ids) for _ in prompts], None, {})
    timings: dict[str, float] = {"generation_s": 0.0}
    completion_tokens: list[int] = []
    generate_and_score = trainer._generate_and_score_completions

    def timed_generation(*a, **kw):
        started = time.perf_counter()
        out = generate_and_score(*a, **kw)
        timings["generation_s"] += time.perf_counter() - started
        completion_tokens.extend(out["completion_mask"].sum(dim=1).tolist())
        return out

    trainer._generate_and_score_completions = timed_generation

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            timings["step_begin"] = time.perf_counter()

        def on_step_end(self, *a, **kw):
            timings["step_s"] = time.perf_counter() - timings["step_begin"]

    trainer.add_callback(StepTimer())
    trainer.train()
    return {
        "system": "trl",
        "step_s": timings["step_s"],
        "generation_s": timings["generation_s"],
        "train_s": timings["step_s"] - timings["generation_s"],
        "completion_tokens": completion_tokens,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


# --- LongStraw -------------------------------------------------------------------------------------


def longstraw_config(root: Path, prompts: Path, checkpoint: str, args) -> dict:
    return {
        "run_id": "longstraw-step",
        "model": {"checkpoint": checkpoint, "dtype": "float32"},
        "engine": {"shard_tokens": args.shard_tokens, "prompt_grad": "exact"},
        "grpo": {
            "num_generations": args.group,
            "max_completion_length": args.completion,
            "learning_rate": 1e-5,
            "loss_type": "dapo",
        },
        "data": {
            "type": "jsonl",
            "path": str(prompts),
            "rewards": ["step_reward:reward"],
        },
        "train": {"num_steps": 1, "groups_per_step": 1, "checkpoint_every": 100, "seed": SEED},
        "storage": {"root_uri": str(root / "longstraw-out"), "persist_mode": "off"},
    }


def longstraw_run(root: Path, checkpoint: str, args) -> tuple[list[str], Path]:
    run_root = root / f"longstraw-run-{time.monotonic_ns()}"
    run_root.mkdir(parents=True)
    config_path = run_root / "run.yaml"
    (run_root / "step_reward.py").write_text(REWARD_SOURCE)
    config = longstraw_config(run_root, root / "prompts.jsonl", checkpoint, args)
    config_path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "longstraw.cli", "train", "--config", str(config_path),
               "--no-prefect"]  # fmt: skip
    return command, run_root


def longstraw_result(run_root: Path) -> dict:
    metrics = run_root / "longstraw-out" / "runs" / "longstraw-step" / "metrics.jsonl"
    row = json.loads(metrics.read_text().splitlines()[-1])
    seconds = row["seconds"]
    generation = sum(seconds.get(k, 0.0) for k in GENERATION_STAGES)
    step = sum(v for k, v in seconds.items() if k not in LEFT_OUT_STAGES)
    return {
        "system": "longstraw",
        "step_s": step,
        "generation_s": generation,
        "train_s": step - generation,
        "stage_s": seconds,
        "completion_tokens": row.get("completion_tokens"),
    }


# --- driver --------------------------------------------------------------------------------------


def one_process(system: str, root: Path, checkpoint: str, args) -> dict:
    env = {**os.environ, **OMP_PASSIVE, "OMP_NUM_THREADS": str(args.threads)}
    if system == "trl":
        command = [sys.executable, __file__, "--worker", "trl", "--root", str(root),
                   "--checkpoint", checkpoint, "--prompt-len", str(args.prompt_len),
                   "--threads", str(args.threads), "--group", str(args.group),
                   "--completion", str(args.completion)]  # fmt: skip
        run_root = None
    else:
        command, run_root = longstraw_run(root, checkpoint, args)
    load_before = os.getloadavg()
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if status != 0:
        raise RuntimeError(f"{system} failed:\n{output.decode(errors='replace')[-4000:]}")
    if system == "trl":
        record = json.loads(output.decode().strip().splitlines()[-1])
    else:
        record = longstraw_result(run_root)
        record["peak_rss_bytes"] = usage.ru_maxrss * 1024
    record["process_peak_rss_bytes"] = usage.ru_maxrss * 1024
    record["process_wall_s"] = wall
    record["load_average_before"] = load_before
    record["load_average_after"] = os.getloadavg()
    return record


def _median(runs: list[dict], system: str, key: str) -> float | None:
    values = [r[key] for r in runs if r["system"] == system and r.get(key) is not None]
    return statistics.median(values) if values else None


def summary(runs: list[dict]) -> dict:
    out = {}
    for key in ("step_s", "generation_s", "train_s", "peak_rss_bytes"):
        trl, ours = _median(runs, "trl", key), _median(runs, "longstraw", key)
        out[key] = {"trl_median": trl, "longstraw_median": ours,
                    "trl_over_longstraw": None if not (trl and ours) else trl / ours}  # fmt: skip
    rounds = sorted({r["round"] for r in runs})
    out["step_ratio_per_round"] = []
    for round_ in rounds:
        pair = {r["system"]: r for r in runs if r["round"] == round_}
        if {"trl", "longstraw"} <= pair.keys():
            out["step_ratio_per_round"].append(pair["trl"]["step_s"] / pair["longstraw"]["step_s"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen3_5", help="qwen3_5 (hybrid) or qwen3 / llama")
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--group", type=int, default=GROUP)
    parser.add_argument("--completion", type=int, default=COMPLETION)
    parser.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--systems", nargs="+", default=["trl", "longstraw"])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "trl":
        print(json.dumps(trl_worker(args.root, args.checkpoint, args.prompt_len, args)))
        return
    runs = []
    with tempfile.TemporaryDirectory(prefix="longstraw-bench-trl-") as tmp:
        root = Path(tmp)
        prepared = prepare(root, args.family, args.size, args.prompt_len, None)
        for round_ in range(args.rounds):
            order = args.systems if round_ % 2 == 0 else list(reversed(args.systems))
            for system in order:
                record = one_process(system, root, prepared["checkpoint"], args)
                record["round"] = round_
                runs.append(record)
                print(
                    f"round {round_} {system}: step {record['step_s']:.1f} s (generation "
                    f"{record['generation_s']:.1f} s, train {record['train_s']:.1f} s), peak RSS "
                    f"{record['peak_rss_bytes'] / 2**30:.2f} GiB, load "
                    f"{record['load_average_before'][0]:.1f}-{record['load_average_after'][0]:.1f}",
                    flush=True,
                )
    result = {
        "family": args.family,
        "size": args.size,
        "prompt_len": args.prompt_len,
        "group": args.group,
        "completion": args.completion,
        "shard_tokens": args.shard_tokens,
        "threads": args.threads,
        "runs": runs,
        "summary": summary(runs),
    }
    ratio = result["summary"]["step_s"]["trl_over_longstraw"]
    if ratio is not None:
        print(f"whole step, TRL / LongStraw (medians): {ratio:.1f}x; per round: "
              + ", ".join(f"{r:.1f}x" for r in result["summary"]["step_ratio_per_round"]))  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
