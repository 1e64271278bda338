"""Markdown tables for docs/benchmarks.md from the suites' JSON results."""

from __future__ import annotations

import json
from pathlib import Path

_GIB = 2**30
_MIB = 2**20


def _gib(value: float | None) -> str:
    return "–" if value is None else f"{value / _GIB:.2f}"


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}×"


def context_table(data: dict) -> str:
    lines = [
        "| method | P | status | peak RSS (GiB) | step (s) | note |",
        "|---|---:|---|---:|---:|---|",
    ]
    for r in data["runs"]:
        spec, status = r["spec"], r["status"]
        res = r.get("result", {})
        peak = res.get("peak_rss_bytes") if status == "ok" else r.get("observed_peak_rss_bytes")
        note = r.get("reason", "")
        if status == "ok" and res.get("step_s_scaled"):
            note = f"{res['measured_sequences']} of G sequences run, time scaled ×G"
        if status == "ok" and "stages_s" in res:
            st = res["stages_s"]
            note = f"prefill {st['prefill']:.1f} + replay {st['replay']:.1f} + sweep {st['sweep']:.1f} s"
        if status in ("oom", "timeout"):
            note = f"killed at the cap; peak seen {_gib(peak)} GiB"
        lines.append(
            f"| {spec['method']} | {spec['prompt_tokens']} | {status} | "
            f"{_gib(peak) if status != 'skipped' else '–'} | {_s(res.get('step_s'))} | {note} |"
        )
    lines += [
        "",
        "| P | full/exact step | full/detached step | full/detached peak | exact − detached peak (MiB) | 1.1 × fp32 K/V (MiB) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for p, pt in data["summary"]["points"].items():
        extra = pt.get("exact_minus_detached_peak_bytes")
        kv = pt.get("kv_fp32_bytes")
        lines.append(
            f"| {p} | {_ratio(pt.get('step_ratio_full_over_exact'))} | "
            f"{_ratio(pt.get('step_ratio_full_over_detached'))} | "
            f"{_ratio(pt.get('peak_ratio_full_over_detached'))} | "
            f"{'–' if extra is None else f'{extra / _MIB:.0f}'} | "
            f"{'–' if kv is None else f'{1.1 * kv / _MIB:.0f}'} |"
        )
    lines += ["", "| method | largest P that ran under the caps | stopped by |", "|---|---:|---|"]
    for m, reach in data["summary"]["reachable"].items():
        why = reach["stopped_by"] + (
            f": {reach['stop_reason']}" if reach.get("stop_reason") else ""
        )
        lines.append(f"| {m} | {reach['max_ok_prompt_tokens']} | {why} |")
    return "\n".join(lines)


def group_table(data: dict) -> str:
    lines = ["| method | G | status | peak RSS (GiB) | step (s) |", "|---|---:|---|---:|---:|"]
    for r in data["runs"]:
        res = r.get("result", {})
        lines.append(
            f"| {r['spec']['method']} | {r['spec']['group_size']} | {r['status']} | "
            f"{_gib(res.get('peak_rss_bytes', r.get('observed_peak_rss_bytes')))} | {_s(res.get('step_s'))} |"
        )
    lines += [
        "",
        "| method | growth G_min → G_max (MiB) | state size (MiB) | growth / state |",
        "|---|---:|---:|---:|",
    ]
    for m, row in data["summary"]["methods"].items():
        if "growth_bytes" in row:
            lines.append(
                f"| {m} | {row['growth_bytes'] / _MIB:.1f} (G={row['growth_from_g']}→{row['growth_to_g']}) | "
                f"{row['state_bytes'] / _MIB:.1f} | {100 * row['growth_fraction_of_state']:.1f} % |"
            )
    return "\n".join(lines)


def prefill_table(data: dict) -> str:
    s = data["summary"]
    if "speed_ratio" not in s:
        return "| run | status |\n|---|---|\n" + "\n".join(
            f"| {r['spec']['method']} | {r['status']} |" for r in data["runs"]
        )
    return "\n".join(
        [
            "| | tokens/s | peak RSS (GiB) | RSS above model+warm-up baseline (GiB) |",
            "|---|---:|---:|---:|",
            f"| LongStraw prefill (shards of {s['shard_tokens']}) | {s['prefill_tokens_per_s']:.0f} | "
            f"{_gib(s['prefill_peak_rss_bytes'])} | {_gib(s['prefill_above_baseline_bytes'])} |",
            f"| transformers forward (no grad, sdpa, logits_to_keep=1) | {s['hf_tokens_per_s']:.0f} | "
            f"{_gib(s['hf_peak_rss_bytes'])} | {_gib(s['hf_above_baseline_bytes'])} |",
            f"| ratio LongStraw / transformers | {s['speed_ratio']:.2f}× | {1 / s['rss_ratio']:.2f}× | |",
        ]
    )


def fidelity_table(data: dict) -> str:
    lines = [
        "| method | cosine to exact gradient | relative error | max abs diff | loss |",
        "|---|---:|---:|---:|---:|",
    ]
    for m, row in data["summary"].items():
        if "skipped" in row:
            lines.append(f"| {m} | skipped: {row['skipped']} | | | |")
        else:
            lines.append(
                f"| {m} | {row['cosine']:.6f} | {row['relative_error']:.2e} | "
                f"{row['max_abs_diff']:.2e} | {row['loss']:.6f} |"
            )
    return "\n".join(lines)


def decode_table(data: dict) -> str:
    sizes = sorted(
        {int(g) for r in data["runs"] if r["status"] == "ok" for g in r["result"]["decode_step_s"]}
    )
    lines = [
        "| P | load | " + " | ".join(f"G = {g}" for g in sizes) + " |",
        "|---|---|" + "---:|" * len(sizes),
    ]
    for r in data["runs"]:
        if r["status"] != "ok":
            lines.append(f"| {r['spec']['prompt_tokens']} | {r['status']} |" + " |" * len(sizes))
            continue
        steps = r["result"]["decode_step_s"]
        load = r.get("load_average", [0.0, 0.0])
        cells = " | ".join(
            f"{1e3 * steps[str(g)]:.1f} ms" if str(g) in steps else "–" for g in sizes
        )
        lines.append(f"| {r['spec']['prompt_tokens']} | {load[0]:.1f}–{load[1]:.1f} | {cells} |")
    same = data["summary"].get("ratio_to_reference_same_process")
    if same:
        ref = data["summary"]["reference_tokens"]
        lines += [
            "",
            f"| P / {ref} (same process) | " + " | ".join(f"G = {g}" for g in sizes) + " |",
            "|---|" + "---:|" * len(sizes),
        ]
        for p, row in same.items():
            lines.append(f"| {p} | " + " | ".join(_ratio(row.get(str(g))) for g in sizes) + " |")
    return "\n".join(lines)


def rollout_table(data: dict) -> str:
    lines = [
        "| P | TRL generation (s) | LongStraw prefill + sampling (s) | TRL / LongStraw (medians) |",
        "|---:|---|---|---:|",
    ]
    for p, point in data["summary"]["points"].items():
        trl = ", ".join(f"{x:.1f}" for x in point.get("trl-generate", {}).get("step_s", []))
        ours = ", ".join(f"{x:.1f}" for x in point.get("rollout", {}).get("step_s", []))
        lines.append(
            f"| {p} | {trl or '–'} | {ours or '–'} | {_ratio(point.get('ratio_trl_over_longstraw'))} |"
        )
    return "\n".join(lines)


def render(results: Path) -> str:
    """Every result file under `results` (sorted by name), as markdown with its command."""
    tables = {
        "prefill": prefill_table,
        "group": group_table,
        "context": context_table,
        "fidelity": fidelity_table,
        "decode": decode_table,
        "rollout": rollout_table,
    }
    parts = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        table = tables.get(data.get("suite"))
        if table is None:
            continue
        m = data["machine"]
        program, _, rest = m["command"].partition(" ")
        if program.endswith(("bench/grpo/__main__.py", "longstraw/bench/__main__.py")):
            program = "longstraw bench"
        command = f"{program} {rest}".strip()
        parts.append(
            f"### {path.name}\n\n`{command}` — {m['date']}, {m['cpus']} CPUs, "
            f"{m['memory_gib']} GiB, torch {m['torch']}, load average at start "
            f"{m['load_average_at_start'][0]:.1f}\n\n{table(data)}\n"
        )
    return "\n".join(parts)
