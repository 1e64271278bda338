"""One GRPO step of `longstraw train` at P = 128K … 2.1M prompt tokens, in the background.

    OMP_NUM_THREADS=1 nohup nice -n 15 .venv/bin/python bench/bench_million_tokens.py \
        --work /work/bench1m-runs --out bench/results/million_tokens.json [--resume] &

Each run of the plan (`--plan P:mode,...`, in order; shortest first) is one `longstraw train
--no-prefect` process (the product's path without Prefect, whose constant start-up of ~10 s is
irrelevant beside hours of prefill) on the `tiny` qwen3_5 checkpoint, built once under `--work`:
the haystack retrieval task of exactly P tokens, G = 8 completions of 16 tokens, 2048-token
prefill shards, state persisted to local Zarr in the background, one step. Every P:mode runs
resident, then (after every resident run of the plan) again under `engine.state_budget_bytes`
(`--budget-mib`) on the disk tier; a budgeted run starts from a hard-linked copy of the resident
run's committed prompt state (same checkpoint, same key), so its prefill is a read-back and its
rollout and backward are what the budget changes; its final checkpoint must equal the resident
run's bitwise (`checkpoint_equal_to_resident`).

Figures come from the run itself: `metrics.jsonl` (StepMetrics: seconds per stage, shards
computed / reused, the tiered store's peak resident bytes and traffic) plus, from this script, a
0.5 s RSS sample of the train process (peak, and the peak within each stage's window, the windows
laid end to end from the recorded stage seconds), the prompt state's bytes on disk, and the load
average. A progress line (shards committed, rate, ETA from a fit of the cumulative shard time to
a + b·k + c·k², attention making shard k cost ∝ k) goes to stdout every `--progress-s`.

`--resume` skips runs already in `--out` and continues an unfinished one: its committed shard
manifests are reused, not recomputed (`longstraw train --resume` when the run has a checkpoint).
`--kill-check P` first runs the kill test at P: an uninterrupted exact step, then the same run
SIGKILLed once half its shards are committed and resumed; the record says how many shards the
resumed process reused and whether the final checkpoints are bitwise equal.
A run whose RSS passes `--rss-cap-gib` is killed and recorded as such.

`--model narrow` runs the plan on a narrower hybrid instead (`narrow_config`: the `tiny`
config with one gated full-attention layer after three Gated DeltaNet layers and one query / kv
head), written under `--work` through the same `write_random_checkpoint` as `init-model`'s; its
runs use their own folders, and its results default to `million_tokens_narrow.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import yaml

RUN_ID = "bench"
MODELS = ("tiny", "narrow")
NARROW = {
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
}
"""What `narrow` changes in the `tiny` qwen3_5 config: one attention layer of one head (the
prompt attention's P² term is 1/8 of tiny's), the Gated DeltaNet and MLP sizes unchanged."""
DEFAULT_PLAN = (
    "131072:detached,131072:exact,524288:detached,1048576:detached,1048576:exact,2097152:detached"
)
STAGE_ORDER = (
    "prefill", "rollout", "reward", "reference", "score_old", "replay", "sweep", "update",
    "checkpoint",
)  # fmt: skip
"""The order `run_step` runs its stages in (the per-stage RSS windows are laid out in it)."""


def narrow_config():
    """The `tiny` qwen3_5 config with `NARROW`'s fields: still both layer kinds, GQA 1:1."""
    from longstraw.models.factory import build_config

    config = build_config("qwen3_5", "tiny")
    for field, value in NARROW.items():
        setattr(config, field, value)
    assert len(config.layer_types) == config.num_hidden_layers
    assert {"linear_attention", "full_attention"} <= set(config.layer_types)
    assert config.num_attention_heads % config.num_key_value_heads == 0
    return config


def add_step_arguments(parser: argparse.ArgumentParser, rss_cap_gib: float) -> None:
    """The arguments of the one-step `longstraw train` runs that `run_yaml` and `launch` make."""
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--completion", type=int, default=16)
    parser.add_argument("--shard-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--progress-s", type=float, default=60.0)
    parser.add_argument("--rss-cap-gib", type=float, default=rss_cap_gib)


def init_model(size: str, model: Path) -> Path:
    """`longstraw init-model`'s qwen3_5 checkpoint of `size` at `model`, built once."""
    if not (model / "longstraw.json").exists():
        subprocess.run([sys.executable, "-m", "longstraw.cli", "init-model", "--family", "qwen3_5",
                        "--size", size, "--out", str(model)], check=True)  # fmt: skip
    return model


def build_model(args) -> Path:
    """The run's checkpoint under `--work`, built once: `init-model`'s tiny, or the narrow one."""
    if args.model == "tiny":
        return init_model("tiny", args.work / "model")
    model = args.work / f"model-{args.model}"
    if not (model / "longstraw.json").exists():
        from longstraw.models.factory import write_random_checkpoint

        write_random_checkpoint(narrow_config(), model)
    return model


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def run_yaml(args, root: Path, prompt_len: int, mode: str, budget: int | None) -> dict:
    engine = {"shard_tokens": args.shard_tokens, "prompt_grad": mode}
    if budget is not None:
        engine |= {"state_budget_bytes": budget, "state_tier": "disk", "state_dir": str(root)}
    return {
        "run_id": RUN_ID,
        "model": {"checkpoint": str(args.model_dir), "dtype": "float32"},
        "engine": engine,
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
        "train": {"num_steps": 1, "groups_per_step": 1, "checkpoint_every": 100},
        "storage": {"root_uri": str(root / "store"), "persist_mode": "background"},
    }


def run_path(root: Path) -> Path:
    return root / "store" / "runs" / RUN_ID


def shard_manifests(root: Path) -> int:
    return sum(1 for _ in run_path(root).glob("policy-v0/prompts/*/shards/*.json"))


def state_bytes_on_disk(root: Path) -> int:
    prompts = run_path(root) / "policy-v0" / "prompts"
    return sum(p.stat().st_size for p in prompts.rglob("*") if p.is_file())


def checkpoint_hashes(root: Path) -> dict[str, str]:
    """sha256 of every safetensors file of the run's latest checkpoint (bitwise comparison)."""
    checkpoints = sorted((run_path(root) / "checkpoints").glob("v*[0-9]"))
    latest = checkpoints[-1]
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(latest.glob("*.safetensors"))
    } | {"version": latest.name}


class Sampler:
    """RSS of the train process and its children every 0.5 s; progress lines every `every_s`."""

    def __init__(self, pid: int, root: Path, total_shards: int, every_s: float, label: str):
        self.pid, self.root, self.total, self.every_s, self.label = (
            pid, root, total_shards, every_s, label,
        )  # fmt: skip
        self.samples: list[tuple[float, int]] = []
        self.shard_times: list[tuple[int, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def rss(self) -> int:
        try:
            procs = [psutil.Process(self.pid), *psutil.Process(self.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += proc.memory_info().rss
        return total

    def _loop(self) -> None:
        last_progress = 0.0
        while not self.stop.is_set():
            now = time.time()
            self.samples.append((now, self.rss()))
            if now - last_progress >= self.every_s:
                last_progress = now
                done = shard_manifests(self.root)
                if not self.shard_times or self.shard_times[-1][0] != done:
                    self.shard_times.append((done, now))
                log(f"{self.label}: shards {done}/{self.total}, RSS {self.samples[-1][1] / 2**30:.2f}"
                    f" GiB, prefill ETA {self.eta_text(done)}")  # fmt: skip
            self.stop.wait(0.5)

    def eta_text(self, done: int) -> str:
        if done >= self.total:
            return "done (rollout / backward / checkpoint running)"
        points = [(k, t) for k, t in self.shard_times if k > self.shard_times[0][0]]
        if len(points) < 3:
            return "(measuring)"
        k0, t0 = self.shard_times[0]
        ks = np.array([k for k, _ in points], dtype=float)
        ts = np.array([t - t0 for _, t in points])
        # Cumulative time from shard k0 to k: b·(k-k0) + c·(k²-k0²), attention's cost ∝ k.
        basis = np.stack([ks - k0, ks**2 - k0**2], axis=1)
        (b, c), *_ = np.linalg.lstsq(basis, ts, rcond=None)
        c = max(c, 0.0)
        remaining = b * (self.total - done) + c * (self.total**2 - done**2)
        return f"{remaining / 3600:.2f} h (at {time.strftime('%H:%M', time.localtime(time.time() + remaining))})"

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def stage_peaks(samples: list[tuple[float, int]], seconds: dict, end: float) -> dict[str, int]:
    """Peak RSS per stage: windows laid end to end backwards from the step's end (`end`, when
    its metrics row appeared) in `STAGE_ORDER` (an estimate: the gaps between stages — reading
    refs, the update's own bookkeeping — fall into a neighbour's window)."""
    total = sum(seconds.get(stage, 0.0) for stage in STAGE_ORDER)
    start = end - total
    peaks = {}
    for stage in STAGE_ORDER:
        length = seconds.get(stage, 0.0)
        if length <= 0:
            continue
        inside = [rss for t, rss in samples if start <= t <= start + length]
        if inside:
            peaks[stage] = max(inside)
        start += length
    return peaks


def launch(args, root: Path, config: dict, label: str, kill_at_shard: int | None = None) -> dict:
    """One `longstraw train` process on `root` (continuing what it holds); its record."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    resume = (run_path(root) / "checkpoints").is_dir() and any(
        (run_path(root) / "checkpoints").iterdir()
    )
    command = [sys.executable, "-m", "longstraw.cli", "train", "--config", str(root / "run.yaml"),
               "--no-prefect", *(["--resume"] if resume else [])]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE"}
    prompt_len = config["data"]["task"]["num_prompt_tokens"]
    total = -(-(prompt_len - 1) // args.shard_tokens)
    before = shard_manifests(root)
    log(f"{label}: start ({' '.join(command[2:])}), {before}/{total} shards already committed")
    started = time.time()
    with open(root / "log.txt", "ab") as out:
        process = subprocess.Popen(
            command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        outcome = "ok"
        with Sampler(process.pid, root, total, args.progress_s, label) as sampler:
            while process.poll() is None:
                if sampler.samples and sampler.samples[-1][1] > args.rss_cap_gib * 2**30:
                    outcome = "rss-cap"
                elif kill_at_shard is not None and shard_manifests(root) >= kill_at_shard:
                    outcome = "killed"
                if outcome != "ok":
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    break
                time.sleep(0.2)
    wall = time.time() - started
    metrics_file = run_path(root) / "metrics.jsonl"
    record = {
        "label": label, "prompt_tokens": prompt_len, "outcome": outcome, "wall_s": wall,
        "returncode": process.returncode, "shards_total": total,
        "shards_committed_at_start": before, "shards_committed_at_end": shard_manifests(root),
        "peak_rss_sampled_bytes": max((rss for _, rss in sampler.samples), default=0),
        "load_avg": os.getloadavg(), "threads": args.threads,
    }  # fmt: skip
    if outcome == "ok" and process.returncode != 0:
        record["outcome"] = "failed"
        record["log_tail"] = (root / "log.txt").read_text(errors="replace")[-3000:]
    if record["outcome"] == "ok":
        row = json.loads(metrics_file.read_text().splitlines()[-1])
        record["metrics"] = row
        record["stage_peak_rss_bytes"] = stage_peaks(
            sampler.samples, row["seconds"], metrics_file.stat().st_mtime
        )
        record["state_bytes_on_disk"] = state_bytes_on_disk(root)
        record["checkpoint_sha256"] = checkpoint_hashes(root)
    log(f"{label}: {record['outcome']} after {wall:.0f} s")
    return record


def linked_copy_of_state(source: Path, target: Path) -> None:
    """`target` starts with `source`'s committed prompt state (hard links: no bytes copied)."""
    src = run_path(source) / "policy-v0" / "prompts"
    dst = run_path(target) / "policy-v0" / "prompts"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst, copy_function=os.link)


def kill_check(args, results: dict, save) -> None:
    label = f"kill-check-{args.kill_check}"
    if label in results:
        return
    config_of = lambda root: run_yaml(args, root, args.kill_check, "exact", None)  # noqa: E731
    folder = label if args.model == "tiny" else f"{label}-{args.model}"
    whole_root, killed_root = args.work / f"{folder}-whole", args.work / f"{folder}-killed"
    whole = launch(args, whole_root, config_of(whole_root), f"{label} uninterrupted")
    total = whole["shards_total"]
    first = launch(args, killed_root, config_of(killed_root), f"{label} killed", total // 2)
    second = launch(args, killed_root, config_of(killed_root), f"{label} resumed")
    metrics = second.get("metrics", {})
    results[label] = {
        "uninterrupted": whole, "killed": first, "resumed": second,
        "shards_reused_after_kill": metrics.get("shards_reused"),
        "shards_computed_after_kill": metrics.get("shards_computed"),
        "checkpoints_bitwise_equal": whole.get("checkpoint_sha256") is not None
        and whole.get("checkpoint_sha256") == second.get("checkpoint_sha256"),
    }  # fmt: skip
    save()
    log(
        f"{label}: {json.dumps({k: v for k, v in results[label].items() if 'shards' in k or 'bitwise' in k})}"
    )


def plot(results: dict, path: Path, model: str = "tiny") -> None:
    """Step time per stage and peak RSS against P, one line per mode (resident runs); prefill
    and whole-step times only from runs that computed every shard themselves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (time_ax, rss_ax) = plt.subplots(1, 2, figsize=(10, 4))
    # The kill check's uninterrupted run is a resident exact step of the same settings.
    points = [r for r in results.values() if "uninterrupted" not in r] + [
        r["uninterrupted"] | {"mode": "exact", "budget_bytes": None}
        for r in results.values()
        if "uninterrupted" in r
    ]
    for mode, marker in (("detached", "o"), ("exact", "s")):
        runs = sorted(
            (r for r in points if r.get("mode") == mode and r.get("budget_bytes") is None
             and r.get("outcome") == "ok"),
            key=lambda r: r["prompt_tokens"],
        )  # fmt: skip
        if not runs:
            continue
        ps = [r["prompt_tokens"] for r in runs]
        # A run that read committed shards back (a resumed one) timed only part of its prefill.
        whole = [r for r in runs if r["metrics"]["shards_reused"] == 0]
        whole_ps = [r["prompt_tokens"] for r in whole]
        prefill = [r["metrics"]["seconds"]["prefill"] / 60 for r in whole]
        time_ax.plot(whole_ps, prefill, marker=marker, label=f"{mode}: prefill")
        sweep = [r["metrics"]["seconds"].get("sweep", 0.0) / 60 for r in runs]
        if any(sweep):
            time_ax.plot(ps, sweep, marker=marker, label=f"{mode}: sweep")
        steps = [sum(r["metrics"]["seconds"].values()) / 60 for r in whole]
        time_ax.plot(whole_ps, steps, marker=marker, linestyle="--", label=f"{mode}: whole step")
        rss_ax.plot(ps, [r["peak_rss_sampled_bytes"] / 2**30 for r in runs], marker=marker,
                    label=f"{mode}: peak RSS")  # fmt: skip
        rss_ax.plot(ps, [r["state_bytes_on_disk"] / 2**30 for r in runs], marker=marker,
                    linestyle=":", label=f"{mode}: state on disk")  # fmt: skip
    for ax, label in ((time_ax, "minutes (one intra-op thread)"), (rss_ax, "GiB")):
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("prompt tokens P")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"One GRPO step of longstraw train, {model} qwen3_5, G = 8, 16-token completions")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(results: dict) -> str:
    """The finished runs as a markdown table (seconds per stage, peak RSS, state bytes)."""
    gib, mib = 2**30, 2**20
    lines = [
        "| P | mode | state | prefill | rollout | reward | replay | sweep | update | checkpoint "
        "| peak RSS | peak RSS per stage (prefill / rollout / replay / sweep) | state on disk "
        "| state resident (peak) | read from tier | shards computed / reused |",
        "|" + "---|" * 16,
    ]
    for r in results.values():
        if r.get("outcome") != "ok" or "metrics" not in r:
            continue
        m, sec, peaks = r["metrics"], r["metrics"]["seconds"], r["stage_peak_rss_bytes"]
        resident = (
            f"{m['state_peak_resident_bytes'] / mib:.1f} MiB"
            if m["state_peak_resident_bytes"] is not None
            else f"all ({r['state_bytes_on_disk'] / mib:.0f} MiB)"
        )
        tier = (
            "resident" if r["budget_bytes"] is None else f"budget {r['budget_bytes'] / mib:g} MiB"
        )
        per_stage = " / ".join(
            f"{peaks[s] / gib:.2f}" if s in peaks else "–"
            for s in ("prefill", "rollout", "replay", "sweep")
        )
        lines.append(
            f"| {r['prompt_tokens']:,} | {r['mode']} | "
            f"{tier} | "
            + " | ".join(f"{sec.get(s, 0.0):.1f} s" for s in
                         ("prefill", "rollout", "reward", "replay", "sweep", "update", "checkpoint"))
            + f" | {r['peak_rss_sampled_bytes'] / gib:.2f} GiB | {per_stage} GiB"
            f" | {r['state_bytes_on_disk'] / mib:.0f} MiB | {resident}"
            f" | {m['state_bytes_read'] / mib:.0f} MiB"
            f" | {m['shards_computed']} / {m['shards_reused']} |"
        )  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default=DEFAULT_PLAN, help="P:mode,... in the order to run")
    parser.add_argument("--work", type=Path, required=True, help="run folders (never committed)")
    parser.add_argument("--model", choices=MODELS, default="tiny", help="the checkpoint to run")
    parser.add_argument("--out", type=Path, default=None,
                        help="bench/results/million_tokens.json (million_tokens_narrow.json)")  # fmt: skip
    parser.add_argument("--resume", action="store_true", help="skip recorded runs, continue one")
    parser.add_argument("--budget-mib", type=float, default=16.0)
    parser.add_argument("--no-budget-runs", action="store_true")
    add_step_arguments(parser, rss_cap_gib=10.0)
    parser.add_argument("--kill-check", type=int, default=None, help="P of the kill test")
    parser.add_argument("--plot", type=Path, default=None, help="only draw `--out` to this PNG")
    parser.add_argument("--table", action="store_true", help="only print `--out` as markdown")
    args = parser.parse_args()
    if args.out is None:
        suffix = "" if args.model == "tiny" else f"_{args.model}"
        args.out = Path(f"bench/results/million_tokens{suffix}.json")
    if args.table:
        print(table(json.loads(args.out.read_text())["runs"]))
        return
    if args.plot is not None:
        document = json.loads(args.out.read_text())
        plot(document["runs"], args.plot, document.get("args", {}).get("model", "tiny"))
        return
    args.work = args.work.resolve()
    previous = json.loads(args.out.read_text()) if args.resume and args.out.exists() else {}
    results = previous.get("runs", {})
    # A resumed plan keeps its recorded runs and the arguments they ran with: `args` is this
    # invocation's, `earlier_args` those of the invocations before it (oldest first).
    earlier = previous.get("earlier_args", []) + ([previous["args"]] if "args" in previous else [])

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".json.tmp")
        meta = {k: str(v) for k, v in vars(args).items()}
        document = {"args": meta} | ({"earlier_args": earlier} if earlier else {})
        tmp.write_text(json.dumps(document | {"runs": results}, indent=2))
        os.replace(tmp, args.out)

    args.model_dir = build_model(args)
    if args.kill_check is not None:
        kill_check(args, results, save)
    # Every resident run first (the plan's order), then the budgeted ones: the figures the
    # plan is for come before the repeats that only change where the state lives.
    entries = [tuple(entry.split(":")) for entry in args.plan.split(",")]
    budget = None if args.no_budget_runs else int(args.budget_mib * 2**20)
    runs = [(length, mode, None) for length, mode in entries]
    runs += [(length, mode, budget) for length, mode in entries if budget is not None]
    for length, mode, budget_bytes in runs:
        suffix = "" if args.model == "tiny" else f"-{args.model}"
        resident = args.work / f"{length}-{mode}{suffix}"
        if budget_bytes is None:
            label, root = f"{length}-{mode}-resident", resident
        else:
            label = f"{length}-{mode}-budget-{args.budget_mib:g}MiB-disk"
            root = resident.with_name(f"{length}-{mode}-budget")
        if results.get(label, {}).get("outcome") == "ok":
            continue
        if budget_bytes is not None:
            if results.get(f"{length}-{mode}-resident", {}).get("outcome") != "ok":
                continue
            linked_copy_of_state(resident, root)
        record = launch(args, root, run_yaml(args, root, int(length), mode, budget_bytes), label)
        record |= {"mode": mode, "budget_bytes": budget_bytes}
        if budget_bytes is not None and record["outcome"] == "ok":
            # The budget moves bytes only: the step's weights must be the resident run's.
            record["checkpoint_equal_to_resident"] = (
                record["checkpoint_sha256"]
                == results[f"{length}-{mode}-resident"]["checkpoint_sha256"]
            )
        results[label] = record
        save()
        if record["outcome"] != "ok":
            log(f"{label}: stopping the plan ({record['outcome']})")
            return


if __name__ == "__main__":
    main()
