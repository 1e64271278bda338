"""How long `longstraw` takes to answer before it does any work — `--help`, each command's
`--help`, a config error — for this tree against a baseline tree (an older commit), in one run.

    git archive <commit> longstraw | tar -x -C /tmp/longstraw-before
    .venv/bin/python bench/bench_cli_startup.py --baseline-tree /tmp/longstraw-before [--runs 5]

Every command line runs `--runs` times as this virtualenv's `longstraw` entry point in a fresh
process, with PYTHONPATH at the tree being timed and an empty working directory (a baseline that
reaches Prefect's set-up writes there), alternating between the two trees so that both see the
same load on a shared machine. Printed and written to bench/results/cli_startup.json: per command
line the median, min and max wall seconds of each tree, the ratio baseline / this tree, the exit
statuses, and the load average before and after. Without --baseline-tree only this tree is timed.
The --help of every command (enumerated from the CLI) is timed for this tree; the baseline's are
not (each of its commands imported the whole stack, as its `longstraw --help` shows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENTRY = Path(sys.executable).parent / "longstraw"


def _command_paths(command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [path]
    for name, sub in getattr(command, "commands", {}).items():
        paths += _command_paths(sub, (*path, name))
    return paths


def _all_helps() -> list[list[str]]:
    import typer

    from longstraw.cli import app

    return [[*path, "--help"] for path in _command_paths(typer.main.get_command(app))]


def _headline(work: Path) -> list[list[str]]:
    """Command lines both trees answer the same way: the help, and config errors (exit 2)."""
    bad = work / "bad.yaml"
    bad.write_text("grpo: {epsilon: 2.0}\n")
    return [
        ["--help"],
        ["train", "--help"],
        ["train", "--config", "missing.yaml"],
        ["train", "--config", str(bad)],
        ["train", "--steps", "0"],
    ]


def _time_once(tree: Path, args: list[str]) -> tuple[float, int]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    with tempfile.TemporaryDirectory(prefix="cli-startup-") as cwd:
        start = time.perf_counter()
        done = subprocess.run(
            [str(ENTRY), *args], cwd=cwd, env=env, capture_output=True, timeout=300
        )
        return time.perf_counter() - start, done.returncode


def _summary(seconds: list[float], codes: list[int]) -> dict:
    return {
        "median_s": round(statistics.median(seconds), 3),
        "min_s": round(min(seconds), 3),
        "max_s": round(max(seconds), 3),
        "runs_s": [round(s, 3) for s in seconds],
        "exit_codes": sorted(set(codes)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", type=Path, help="a tree holding an older `longstraw/`")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/cli_startup.json")
    args = parser.parse_args()
    assert shutil.which(str(ENTRY)), f"{ENTRY} is not installed (pip install -e .)"
    trees = {"this": REPO}
    if args.baseline_tree is not None:
        assert (args.baseline_tree / "longstraw" / "cli.py").exists(), args.baseline_tree
        trees["baseline"] = args.baseline_tree.resolve()
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="cli-startup-inputs-") as inputs:
        headline = _headline(Path(inputs))
        lines = [(line, tuple(trees)) for line in headline]
        lines += [(line, ("this",)) for line in _all_helps() if line not in headline]
        for line, timed in lines:
            samples: dict[str, tuple[list[float], list[int]]] = {t: ([], []) for t in timed}
            for _ in range(args.runs):
                for tree in timed:  # alternating: both trees under the same load
                    seconds, code = _time_once(trees[tree], line)
                    samples[tree][0].append(seconds)
                    samples[tree][1].append(code)
            row = {"command": "longstraw " + " ".join(line).replace(inputs, "<tmp>")}
            row |= {tree: _summary(*samples[tree]) for tree in timed}
            if len(timed) == 2:
                row["ratio_baseline_over_this"] = round(
                    row["baseline"]["median_s"] / row["this"]["median_s"], 1
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "bench": "cli_startup",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "runs": args.runs,
        "trees": {name: str(path) for name, path in trees.items()},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in os.getloadavg()],
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
