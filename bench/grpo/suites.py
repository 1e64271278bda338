"""Benchmark suites: sets of isolated runs, summarised as ratios within the same run.

- `prefill_suite`: LongStraw's sharded prefill vs transformers' plain forward (tokens/s, RSS).
- `group_suite`: peak RSS against the group size G at a fixed prompt length.
- `context_suite`: peak RSS and step time against P at fixed G, each method until it fails a cap;
  a point whose predicted time (the last time × the length ratio, a lower bound as cost grows at
  least linearly in P) passes the time cap is recorded as "skipped" with that reason.
- `fidelity_suite`: each method's gradient against the exact full-sequence gradient.
- `rollout_suite`: LongStraw's prefill + sampling against TRL's generation for one group, the
  two systems alternated (each run its own process), `repeats` runs of each per prompt length.
- `decode_suite`: the time of one decoding step against P and G (one process per P).

Every suite returns a JSON-able dict: the machine, the command, every run record, a summary.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.grpo.runner import run_isolated
from bench.grpo.workload import BenchSpec

Progress = Callable[[dict], None]


def machine() -> dict:
    mem_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "device": "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": os.getloadavg(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }


def peak_of(record: dict) -> int:
    """Peak RSS of a run: the child's own high-water mark, or what the parent saw before a kill."""
    if record["status"] == "ok":
        return record["result"]["peak_rss_bytes"]
    return record.get("observed_peak_rss_bytes", 0)


def _ok(record: dict | None) -> bool:
    return record is not None and record["status"] == "ok"


def prefill_suite(
    checkpoint: str,
    *,
    prompt_tokens: int,
    shard_tokens: int,
    time_cap_s: float,
    mem_cap_bytes: int,
    progress: Progress = print,
) -> dict:
    info = machine()
    runs = {}
    for method in ("prefill", "hf-forward"):
        spec = BenchSpec(
            method=method,
            checkpoint=checkpoint,
            prompt_tokens=prompt_tokens,
            shard_tokens=shard_tokens,
        )
        runs[method] = run_isolated(spec, time_cap_s=time_cap_s, mem_cap_bytes=mem_cap_bytes)
        progress(runs[method])
    summary: dict = {"prompt_tokens": prompt_tokens, "shard_tokens": shard_tokens}
    if _ok(runs["prefill"]) and _ok(runs["hf-forward"]):
        ls, hf = runs["prefill"]["result"], runs["hf-forward"]["result"]
        summary.update(
            prefill_tokens_per_s=ls["tokens_per_s"],
            hf_tokens_per_s=hf["tokens_per_s"],
            speed_ratio=ls["tokens_per_s"] / hf["tokens_per_s"],
            prefill_peak_rss_bytes=ls["peak_rss_bytes"],
            hf_peak_rss_bytes=hf["peak_rss_bytes"],
            prefill_above_baseline_bytes=ls["peak_rss_bytes"] - ls["baseline_rss_bytes"],
            hf_above_baseline_bytes=hf["peak_rss_bytes"] - hf["baseline_rss_bytes"],
            rss_ratio=hf["peak_rss_bytes"] / ls["peak_rss_bytes"],
            state_bytes=ls["state_bytes"],
        )
    return {
        "suite": "prefill",
        "machine": info,
        "runs": list(runs.values()),
        "summary": summary,
    }


def group_suite(
    checkpoint: str,
    *,
    prompt_tokens: int,
    group_sizes: Sequence[int],
    methods: Sequence[str],
    shard_tokens: int,
    time_cap_s: float,
    mem_cap_bytes: int,
    progress: Progress = print,
) -> dict:
    info = machine()
    runs: list[dict] = []
    summary: dict = {"prompt_tokens": prompt_tokens, "methods": {}}
    for method in methods:
        by_g = {}
        for g in group_sizes:
            spec = BenchSpec(
                method=method,
                checkpoint=checkpoint,
                prompt_tokens=prompt_tokens,
                group_size=g,
                shard_tokens=shard_tokens,
            )
            record = run_isolated(spec, time_cap_s=time_cap_s, mem_cap_bytes=mem_cap_bytes)
            progress(record)
            runs.append(record)
            by_g[g] = record
        ok = {g: r["result"] for g, r in by_g.items() if _ok(r)}
        row: dict = {
            "peak_rss_bytes": {g: peak_of(r) for g, r in by_g.items()},
            "status": {g: r["status"] for g, r in by_g.items()},
            "step_s": {g: r["step_s"] for g, r in ok.items()},
        }
        if len(ok) >= 2:
            g_lo, g_hi = min(ok), max(ok)
            state = ok[g_hi].get("state_bytes", 0)
            growth = ok[g_hi]["peak_rss_bytes"] - ok[g_lo]["peak_rss_bytes"]
            row.update(
                growth_from_g=g_lo,
                growth_to_g=g_hi,
                growth_bytes=growth,
                state_bytes=state,
                growth_fraction_of_state=growth / state if state else None,
            )
            if 2 in ok and 8 in ok:
                row["growth_g2_to_g8_bytes"] = ok[8]["peak_rss_bytes"] - ok[2]["peak_rss_bytes"]
        summary["methods"][method] = row
    return {"suite": "group", "machine": info, "runs": runs, "summary": summary}


def context_suite(
    checkpoint: str,
    *,
    prompt_lengths: Sequence[int],
    group_size: int,
    methods: Sequence[str],
    shard_tokens: int,
    time_cap_s: float,
    mem_cap_bytes: int,
    progress: Progress = print,
) -> dict:
    info = machine()
    runs: list[dict] = []
    by_method: dict[str, dict[int, dict]] = {}
    for method in methods:
        by_method[method] = {}
        previous: dict | None = None
        for p in sorted(prompt_lengths):
            spec = BenchSpec(
                method=method,
                checkpoint=checkpoint,
                prompt_tokens=p,
                group_size=group_size,
                shard_tokens=shard_tokens,
            )
            if previous is not None and previous["status"] != "ok":
                record = {
                    "spec": spec.model_dump(),
                    "status": "skipped",
                    "reason": f"failed at P={previous['spec']['prompt_tokens']} "
                    f"({previous['status']})",
                }
            elif (
                previous is not None
                and previous["wall_s"] * p / previous["spec"]["prompt_tokens"] > time_cap_s
            ):
                predicted = previous["wall_s"] * p / previous["spec"]["prompt_tokens"]
                record = {
                    "spec": spec.model_dump(),
                    "status": "skipped",
                    "reason": f"predicted >= {predicted:.0f} s (linear in P from "
                    f"P={previous['spec']['prompt_tokens']}) > time cap "
                    f"{time_cap_s:.0f} s",
                }
            else:
                record = run_isolated(spec, time_cap_s=time_cap_s, mem_cap_bytes=mem_cap_bytes)
            progress(record)
            runs.append(record)
            by_method[method][p] = record
            if record["status"] != "skipped":
                previous = record
    summary: dict = {
        "group_size": group_size,
        "mem_cap_bytes": mem_cap_bytes,
        "time_cap_s": time_cap_s,
        "points": {},
        "reachable": {},
    }
    for p in sorted(prompt_lengths):
        point: dict = {}
        res = {m: by_method[m][p]["result"] for m in methods if _ok(by_method[m].get(p))}
        for m in methods:
            r = by_method[m].get(p)
            point[m] = {
                "status": r["status"],
                "peak_rss_bytes": peak_of(r) if r else None,
                "step_s": res[m]["step_s"] if m in res else None,
            }
        full, exact, det = (
            res.get("full-sequence"),
            res.get("longstraw-exact"),
            res.get("longstraw-detached"),
        )
        if full and exact:
            point["step_ratio_full_over_exact"] = full["step_s"] / exact["step_s"]
            point["peak_ratio_full_over_exact"] = full["peak_rss_bytes"] / exact["peak_rss_bytes"]
        if full and det:
            point["step_ratio_full_over_detached"] = full["step_s"] / det["step_s"]
            point["peak_ratio_full_over_detached"] = full["peak_rss_bytes"] / det["peak_rss_bytes"]
        if exact and det:
            extra = exact["peak_rss_bytes"] - det["peak_rss_bytes"]
            point["exact_minus_detached_peak_bytes"] = extra
            point["kv_fp32_bytes"] = exact["kv_fp32_bytes"]
            point["exact_memory_target_met"] = extra <= 1.1 * exact["kv_fp32_bytes"]
        summary["points"][p] = point
    for m in methods:
        ok = [p for p, r in by_method[m].items() if r["status"] == "ok"]
        first_fail = [r for p, r in sorted(by_method[m].items()) if r["status"] != "ok"]
        summary["reachable"][m] = {
            "max_ok_prompt_tokens": max(ok) if ok else None,
            "stopped_by": first_fail[0]["status"] if first_fail else "none (all lengths ran)",
            "stop_reason": first_fail[0].get("reason") if first_fail else None,
        }
    return {"suite": "context", "machine": info, "runs": runs, "summary": summary}


def fidelity_suite(
    checkpoint: str,
    *,
    prompt_tokens: int,
    group_size: int,
    shard_tokens: int,
    time_cap_s: float,
    mem_cap_bytes: int,
    progress: Progress = print,
) -> dict:
    info = machine()
    spec = BenchSpec(
        method="fidelity",
        checkpoint=checkpoint,
        prompt_tokens=prompt_tokens,
        group_size=group_size,
        shard_tokens=shard_tokens,
    )
    record = run_isolated(spec, time_cap_s=time_cap_s, mem_cap_bytes=mem_cap_bytes)
    progress(record)
    summary = record["result"]["methods"] if _ok(record) else {}
    return {"suite": "fidelity", "machine": info, "runs": [record], "summary": summary}


def _timed_run(spec: BenchSpec, time_cap_s: float, mem_cap_bytes: int) -> dict:
    """`run_isolated` with the 1-minute load average before and after the run in the record."""
    before = os.getloadavg()[0]
    record = run_isolated(spec, time_cap_s=time_cap_s, mem_cap_bytes=mem_cap_bytes)
    record["load_average"] = [before, os.getloadavg()[0]]
    return record


def rollout_suite(
    checkpoint: str,
    *,
    prompt_lengths: Sequence[int],
    group_size: int,
    response_tokens: int,
    repeats: int,
    shard_tokens: int,
    time_cap_s: float,
    mem_cap_bytes: int,
    methods: Sequence[str] = ("trl-generate", "rollout"),
    progress: Progress = print,
) -> dict:
    """Alternated: for each P and repeat, every method once, the order reversed every repeat."""
    info = machine()
    runs: list[dict] = []
    for p in prompt_lengths:
        for repeat in range(repeats):
            order = list(methods) if repeat % 2 == 0 else list(reversed(methods))
            for method in order:
                spec = BenchSpec(
                    method=method,
                    checkpoint=checkpoint,
                    prompt_tokens=p,
                    group_size=group_size,
                    response_tokens=response_tokens,
                    shard_tokens=shard_tokens,
                )
                record = _timed_run(spec, time_cap_s, mem_cap_bytes)
                progress(record)
                runs.append(record)
    points: dict = {}
    for p in prompt_lengths:
        point: dict = {}
        for method in methods:
            ok = [
                r["result"]
                for r in runs
                if r["spec"]["prompt_tokens"] == p and r["spec"]["method"] == method and _ok(r)
            ]
            point[method] = {
                "runs_ok": len(ok),
                "step_s": [r["step_s"] for r in ok],
                "median_step_s": statistics.median([r["step_s"] for r in ok]) if ok else None,
            }
            if ok and "prefill_s" in ok[0]:
                point[method]["prefill_s"] = [r["prefill_s"] for r in ok]
                point[method]["sampling_s"] = [r["sampling_s"] for r in ok]
        trl, ours = point.get("trl-generate", {}), point.get("rollout", {})
        if trl.get("median_step_s") and ours.get("median_step_s"):
            point["ratio_trl_over_longstraw"] = trl["median_step_s"] / ours["median_step_s"]
        points[p] = point
    loads = [x for r in runs for x in r.get("load_average", [])]
    summary = {
        "group_size": group_size,
        "response_tokens": response_tokens,
        "repeats": repeats,
        "points": points,
        "load_average_range": [min(loads), max(loads)] if loads else None,
    }
    return {"suite": "rollout", "machine": info, "runs": runs, "summary": summary}


def decode_suite(
    checkpoint: str,
    *,
    prompt_lengths: Sequence[int],
    group_sizes: Sequence[int],
    response_tokens: int,
    shard_tokens: int,
    time_cap_s: float,
    mem_cap_bytes: int,
    repeats: int = 1,
    reference_tokens: int = 0,
    progress: Progress = print,
) -> dict:
    """Per P one process: prefill, then `response_tokens` decoding steps for each G (and, with
    `reference_tokens`, the same from the state of the prompt's first `reference_tokens` tokens,
    alternated in the same process)."""
    info = machine()
    runs: list[dict] = []
    for p in prompt_lengths:
        spec = BenchSpec(
            method="decode-steps",
            checkpoint=checkpoint,
            prompt_tokens=p,
            group_size=max(group_sizes),
            response_tokens=response_tokens,
            shard_tokens=shard_tokens,
            decode_group_sizes=tuple(group_sizes),
            decode_repeats=repeats,
            decode_reference_tokens=reference_tokens,
        )
        record = _timed_run(spec, time_cap_s, mem_cap_bytes)
        progress(record)
        runs.append(record)
    step_s = {
        r["spec"]["prompt_tokens"]: {int(g): s for g, s in r["result"]["decode_step_s"].items()}
        for r in runs
        if _ok(r)
    }
    summary: dict = {
        "response_tokens": response_tokens,
        "repeats": repeats,
        "decode_step_s": step_s,
    }
    same_process = {
        r["spec"]["prompt_tokens"]: {
            int(g): x for g, x in r["result"]["ratio_to_reference"].items()
        }
        for r in runs
        if _ok(r) and "ratio_to_reference" in r["result"]
    }
    if same_process:
        summary["reference_tokens"] = reference_tokens
        summary["ratio_to_reference_same_process"] = same_process
    if len(step_s) >= 2:
        p_lo, p_hi = min(step_s), max(step_s)
        summary["ratio_longest_over_shortest"] = {
            g: step_s[p_hi][g] / step_s[p_lo][g] for g in step_s[p_lo] if g in step_s[p_hi]
        }
        summary["ratio_prompt_lengths"] = [p_lo, p_hi]
    return {"suite": "decode", "machine": info, "runs": runs, "summary": summary}
