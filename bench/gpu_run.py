"""The GPU self-check as the GPU machine runs it: the environment, then every section of
`bench/gpu_selfcheck.py` in its own process under a time limit, merged into one report.

    bash bench/gpu_run.sh OUT            # the one command (it installs the carried wheels first)
    python bench/gpu_run.py OUT --smoke  # the same on a CPU: the smoke configuration, seconds

One process per section: a CUDA error such as an illegal address leaves the process's CUDA
context unusable for every later call, and a kernel that hangs cannot be interrupted from
Python; a section in its own process, killed at its limit, fails alone and the next one runs.
The limit of a section is its self-check hard limit (1.2 x budget + 10 s) plus `STARTUP_S`,
cut to what is left of the run's deadline; a section with under `MIN_SECTION_S` left is
recorded as failed, not started. The sections together never pass `--deadline` (default
`DEADLINE_S`).

Writes `OUT/gpu_selfcheck.json` and `OUT/gpu_selfcheck.md` after every section (a run killed
from outside keeps what finished); the sections' own output goes to stdout. Exit status: 0
every section ran (`ok`, or `partial`: configurations skipped for time are recorded results),
1 a section failed, mismatched, was killed or exited non-zero, 3 the environment is not ready
(torch does not import, or no CUDA device without `--smoke`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SELFCHECK = HERE / "gpu_selfcheck.py"
SECTIONS = ("kernels", "parity", "exact_gradient", "scale", "tiers")

# Soft budgets on one GPU, 345 s in all: the self-check's own (465 s) cut so that every section
# at its whole budget, with its process's start, fits DEADLINE_S (overruns past the budgets are
# cut by the deadline); `scale` keeps the most (the 1M-token rows) and skips what would not fit.
GPU_BUDGETS_S = {"kernels": 30, "parity": 45, "exact_gradient": 45, "scale": 180, "tiers": 45}
# The sections together: with the wheels' install (~5 s) and the environment probe (~10 s) the
# command ends under 8 minutes, and a second run fits in a 15-minute device window.
DEADLINE_S = 450.0
# A section process's start before its clock runs: torch, the CUDA context, tiny checkpoints.
STARTUP_S = 45.0
# gpu_selfcheck.SMOKE's budget of every section.
SMOKE_BUDGET_S = 60.0
# Less than this left of the deadline: a section could not even start its models.
MIN_SECTION_S = 20.0
EXIT_OK, EXIT_FAILED, EXIT_NOT_READY = 0, 1, 3

_PROBE = """
import json, sys
sys.path.insert(0, {bench!r})
import torch, gpu_selfcheck
device = torch.device({device!r} or ("cuda" if torch.cuda.is_available() else "cpu"))
print(json.dumps(gpu_selfcheck.environment(device)))
"""


def hard_limit_s(budget_s: float) -> float:
    """The self-check's own hard limit of a section (gpu_selfcheck.run_section)."""
    return budget_s * 1.2 + 10


def probe_environment(python: str, device: str | None) -> dict:
    """gpu_selfcheck.environment() from a short process of its own: this one never touches CUDA
    (its context would hold device memory through every section)."""
    code = _PROBE.format(bench=str(HERE), device=device or "")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"the environment probe exited with {done.returncode}:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def environment_lines(env: dict) -> list[str]:
    """The environment as the few lines the run prints first."""
    kernels = ", ".join(
        f"{dist} {version or 'not installed'}" for dist, version in env["kernel_packages"].items()
    )
    card = env.get("device_name", "no CUDA device")
    if "device_memory_bytes" in env:
        card += f", {env['device_memory_bytes'] / 2**30:.1f} GiB, capability {env['capability']}"
    return [
        f"device: {env['device']} ({card}); driver {env.get('driver')}",
        f"python {env['python']}, torch {env['torch']} (CUDA {env['cuda']}), "
        f"transformers {env['transformers']}",
        f"kernels: {kernels}",
    ]


def run_section_process(command: list[str], limit_s: float) -> tuple[int, bool, float]:
    """(exit code, killed at `limit_s`, seconds) of `command` in a new process group, killed
    whole at the limit."""
    started = time.perf_counter()
    process = subprocess.Popen(command, start_new_session=True)
    try:
        code, killed = process.wait(timeout=limit_s), False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        code, killed = process.wait(), True
    return code, killed, time.perf_counter() - started


def read_report(path: Path) -> dict | None:
    """A section process's report; None when it wrote none (killed or crashed first)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def section_record(
    name: str, report: dict | None, code: int, killed: bool, seconds: float, limit_s: float
) -> dict:
    """The section's record from its process's `report`, with the exit code; when the process
    left none (killed, crashed), a failed record that says why."""
    record = (report or {}).get("sections", {}).get(name)
    if record is None:
        reason = (
            f"killed at its limit of {limit_s:.0f} s"
            if killed
            else f"exited with code {code} before writing its report"
        )
        record = {"status": "failed", "reason": reason, "seconds": round(seconds, 3)}
    elif code != 0 and record.get("status") != "failed":
        record = {**record, "status": "failed", "reason": f"exited with code {code}"}
    return {**record, "exit_code": code, "limit_s": round(limit_s, 1)}


def merged_report(mode: str, env: dict, sections: dict, reports: dict[str, dict], seconds: float):
    """One report of the per-section runs (`reports`: section -> its process's report) in
    gpu_selfcheck's format, so that its markdown reads it."""
    config = {}
    for name, report in reports.items():
        budgets = {**config.get("budgets_s", {}), name: report["config"]["budgets_s"][name]}
        config = {**report["config"], "budgets_s": budgets}
    unchanged = [report.get("settings_unchanged") for report in reports.values()]
    return {
        "mode": mode,
        "config": config,
        "environment": env,
        "sections": sections,
        "seconds": seconds,
        "settings_unchanged": bool(unchanged) and all(unchanged),
        "torch_flags_after": {n: r.get("torch_flags_after") for n, r in reports.items()},
    }


def exit_status(sections: dict) -> int:
    """0 when every section ran (ok or partial), 1 otherwise."""
    ran = all(
        s["status"] in ("ok", "partial") and s.get("exit_code", 0) == 0 for s in sections.values()
    )
    return EXIT_OK if ran else EXIT_FAILED


def write_report(report: dict, out: Path) -> None:
    """JSON and markdown, each written whole under a temporary name and renamed."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from gpu_selfcheck import markdown

    for name, text in (
        ("gpu_selfcheck.json", json.dumps(report, indent=1, default=str)),
        ("gpu_selfcheck.md", markdown(report)),
    ):
        partial = out / f".{name}.tmp"
        partial.write_text(text)
        partial.replace(out / name)


def section_command(name: str, out: Path, budget_s: float | None, args) -> list[str]:
    """The self-check of section `name` alone, writing under `out`; `budget_s` None: smoke."""
    command = [sys.executable, str(SELFCHECK), "--sections", name, "--out", str(out)]
    command += ["--smoke"] if budget_s is None else ["--budget", f"{name}={budget_s:g}"]
    if args.device:
        command += ["--device", args.device]
    if args.scale_lengths:
        command += ["--scale-lengths", *map(str, args.scale_lengths)]
    return command


def run_sections(args, budgets: dict[str, float] | None, env: dict, started: float) -> dict:
    """Each section of `args.sections` in its own process under its limit, the merged report
    rewritten after each; returns {section: record}."""
    sections, reports = {}, {}
    with tempfile.TemporaryDirectory(prefix="longstraw-gpu-run-") as scratch:
        for name in args.sections:
            left = args.deadline - (time.perf_counter() - started)
            budget = None if budgets is None else budgets[name]
            limit = min(
                hard_limit_s(SMOKE_BUDGET_S if budget is None else budget) + STARTUP_S, left
            )
            if left < MIN_SECTION_S:
                reason = f"not started: {left:.0f} s left of the run's {args.deadline:.0f} s"
                sections[name] = {"status": "failed", "reason": reason, "seconds": 0.0}
            else:
                print(f"== {name}: budget {budget or 'smoke'} s, limit {limit:.0f} s", flush=True)
                out = Path(scratch) / name
                code, killed, seconds = run_section_process(
                    section_command(name, out, budget, args), limit
                )
                report = read_report(out / "gpu_selfcheck.json")
                sections[name] = section_record(name, report, code, killed, seconds, limit)
                if report is not None:
                    reports[name] = report
            print(f"== {name}: {sections[name]['status']}", flush=True)
            mode = "smoke" if budgets is None else "full"
            elapsed = time.perf_counter() - started
            write_report(merged_report(mode, env, sections, reports, elapsed), args.out)
    return sections


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder of gpu_selfcheck.json and .md")
    parser.add_argument("--smoke", action="store_true", help="tiny models and prompts (a CPU)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds, all sections")
    parser.add_argument(
        "--budget", action="append", default=[], metavar="SECTION=SECONDS",
        help="a section's soft budget on the GPU, e.g. --budget scale=300 (repeatable)",
    )  # fmt: skip
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--scale-lengths", type=int, nargs="+", help="the scale section's P")
    args = parser.parse_args(argv)
    budgets = dict(GPU_BUDGETS_S)
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in SECTIONS:
            parser.error(f"--budget {item}: the section must be one of {', '.join(SECTIONS)}")
        budgets[name] = float(seconds)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)

    try:
        env = probe_environment(sys.executable, args.device)
    except Exception as exc:
        print(f"gpu_run: environment not ready: {exc}", file=sys.stderr)
        return EXIT_NOT_READY
    for line in environment_lines(env):
        print(line, flush=True)
    if not args.smoke and not env["cuda_available"]:
        print("gpu_run: no CUDA device: the full check needs one (--smoke runs on a CPU)")
        return EXIT_NOT_READY

    sections = run_sections(args, None if args.smoke else budgets, env, started)
    status = exit_status(sections)
    print(f"wrote {args.out / 'gpu_selfcheck.json'} and {args.out / 'gpu_selfcheck.md'}")
    print(f"gpu_run: exit {status} ({'every section ran' if status == 0 else 'a section failed'})")
    return status


if __name__ == "__main__":
    sys.exit(main())
