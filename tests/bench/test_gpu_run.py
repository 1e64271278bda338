"""The GPU machine's one command (`bench/gpu_run.sh` -> `bench/gpu_run.py`) and what it carries.

The runner's own logic (limits, kills, merging, exit status) runs against a stand-in self-check
script that behaves per section as told; one run goes end to end through the shell script on
the real self-check (smoke, one section) with this environment's packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

# What each section of the stand-in does: write a report with this status and exit 0, sleep
# past any limit, exit 7 before writing, or write an ok report and then exit 1.
_STAND_IN = """
import json, sys, time
from pathlib import Path
args = sys.argv[1:]
name, out = args[args.index("--sections") + 1], Path(args[args.index("--out") + 1])
budget = float(args[args.index("--budget") + 1].split("=")[1]) if "--budget" in args else 60.0
behaviour = {behaviour!r}[name]
if behaviour == "sleep":
    time.sleep(60)
if behaviour == "crash":
    sys.exit(7)
status = "ok" if behaviour == "ok then exit 1" else behaviour
out.mkdir(parents=True, exist_ok=True)
record = {{"status": status, "seconds": 0.01, "budget_s": budget, "rows": [{{"status": status}}]}}
report = {{"config": {{"budgets_s": {{name: budget}}, "smoke_flag": "--smoke" in args}},
          "sections": {{name: record}}, "settings_unchanged": True, "torch_flags_after": {{}}}}
(out / "gpu_selfcheck.json").write_text(json.dumps(report))
sys.exit(1 if behaviour == "ok then exit 1" else 0)
"""

_ENV = {
    "python": "3.12.3",
    "torch": "2.11.0+cu130",
    "cuda": "13.0",
    "transformers": "5.24.0",
    "kernel_packages": {"flash-attn": None, "flash-linear-attention": None, "triton": "3.6.0"},
    "device": "cuda",
    "cuda_available": True,
    "device_name": "a stand-in card",
    "device_memory_bytes": 80 * 2**30,
    "capability": "9.0",
    "driver": "580.159.04",
}


@pytest.fixture(scope="module")
def gpu_run(bench_script):
    return bench_script("gpu_run")


@pytest.fixture
def stand_in(gpu_run, tmp_path, monkeypatch):
    """Run gpu_run.main against a stand-in self-check behaving per section; returns a runner
    (behaviour by section, CLI arguments) -> (exit status, report, markdown, stdout)."""

    def run(behaviour: dict[str, str], argv: list[str], env: dict = _ENV, capsys=None):
        script = tmp_path / "stand_in.py"
        script.write_text(_STAND_IN.format(behaviour=behaviour))
        monkeypatch.setattr(gpu_run, "SELFCHECK", script)
        monkeypatch.setattr(gpu_run, "probe_environment", lambda python, device: env)
        # A section's limit: its budget (the stand-in starts in well under a second).
        monkeypatch.setattr(gpu_run, "hard_limit_s", lambda budget: budget)
        monkeypatch.setattr(gpu_run, "STARTUP_S", 0.0)
        monkeypatch.setattr(gpu_run, "MIN_SECTION_S", 0.5)
        out = tmp_path / "out"
        status = gpu_run.main([str(out), *argv])
        report_path = out / "gpu_selfcheck.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        md = (out / "gpu_selfcheck.md").read_text() if report_path.exists() else None
        return status, report, md

    return run


@pytest.mark.processes
def test_each_section_runs_alone_and_a_kill_or_crash_fails_only_its_own(stand_in):
    behaviour = {
        "kernels": "ok",
        "parity": "sleep",
        "exact_gradient": "crash",
        "scale": "partial",
        "tiers": "ok then exit 1",
    }
    budgets = ["kernels=30", "parity=1", "exact_gradient=30", "scale=30", "tiers=30"]
    status, report, md = stand_in(behaviour, [f"--budget={b}" for b in budgets])
    sections = report["sections"]
    assert status == 1
    assert list(sections) == list(behaviour)
    assert sections["kernels"]["status"] == "ok" and sections["kernels"]["exit_code"] == 0
    assert sections["parity"]["status"] == "failed"
    assert sections["parity"]["reason"] == "killed at its limit of 1 s"
    assert sections["parity"]["exit_code"] < 0  # the signal that killed it
    assert sections["exact_gradient"] == {
        **sections["exact_gradient"],
        "status": "failed",
        "reason": "exited with code 7 before writing its report",
        "exit_code": 7,
    }
    # The sections after a kill and a crash still ran, each with its own budget.
    assert sections["scale"]["status"] == "partial" and sections["scale"]["exit_code"] == 0
    assert sections["tiers"]["status"] == "failed"
    assert sections["tiers"]["reason"] == "exited with code 1"
    assert sections["tiers"]["rows"] == [{"status": "ok"}]  # what it wrote is kept
    assert report["config"]["budgets_s"] == {"kernels": 30, "scale": 30, "tiers": 30}
    assert report["mode"] == "full" and report["environment"] == _ENV
    assert "| parity | failed | killed at its limit of 1 s |" in md
    assert "driver 580.159.04" in md and "a stand-in card" in md


@pytest.mark.processes
def test_every_section_that_ran_gives_exit_status_zero_partial_included(stand_in):
    behaviour = {"kernels": "ok", "scale": "partial"}
    status, report, _ = stand_in(behaviour, ["--sections", "kernels", "scale"])
    assert status == 0
    assert [s["status"] for s in report["sections"].values()] == ["ok", "partial"]


@pytest.mark.processes
def test_smoke_runs_the_selfchecks_smoke_configuration_on_a_cpu(stand_in):
    cpu = {**_ENV, "device": "cpu", "cuda_available": False}
    status, report, _ = stand_in({"tiers": "ok"}, ["--smoke", "--sections", "tiers"], env=cpu)
    assert status == 0 and report["mode"] == "smoke"
    assert report["config"]["smoke_flag"] is True


def test_a_spent_deadline_starts_no_section_and_fails(stand_in):
    status, report, _ = stand_in({"kernels": "sleep"}, ["--sections", "kernels", "--deadline", "0"])
    assert status == 1
    assert report["sections"]["kernels"]["status"] == "failed"
    assert report["sections"]["kernels"]["reason"].startswith("not started: ")


def test_the_full_check_without_cuda_stops_before_any_section(stand_in):
    cpu = {**_ENV, "device": "cpu", "cuda_available": False}
    status, report, _ = stand_in({"kernels": "ok"}, [], env=cpu)
    assert status == 3 and report is None


def test_an_unknown_budget_section_is_refused(gpu_run, tmp_path):
    with pytest.raises(SystemExit):
        gpu_run.main([str(tmp_path), "--budget", "nosuch=1"])


def test_gpu_budgets_with_process_starts_fit_the_deadline(gpu_run):
    """Every section at its whole budget, each process starting in `STARTUP_S / 3`: inside the
    deadline, which leaves the command under 8 minutes (docs/benchmarks.md, GPU)."""
    assert set(gpu_run.GPU_BUDGETS_S) == set(gpu_run.SECTIONS)
    typical = sum(gpu_run.GPU_BUDGETS_S.values()) + len(gpu_run.SECTIONS) * gpu_run.STARTUP_S / 3
    assert typical <= gpu_run.DEADLINE_S <= 8 * 60 - 30, (typical, gpu_run.DEADLINE_S)


def test_smoke_budget_is_the_selfchecks(gpu_run, bench_script):
    smoke = bench_script("gpu_selfcheck").SMOKE
    assert set(smoke.budgets_s.values()) == {gpu_run.SMOKE_BUDGET_S}


# --- the shell script ----------------------------------------------------------------------------


def _run_script(out: Path, *args: str, wheels: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_WHEELS": wheels, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        ["bash", str(BENCH / "gpu_run.sh"), str(out), *args],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip


@pytest.mark.processes
def test_the_script_without_the_carried_wheels_says_how_to_get_them(tmp_path):
    empty = tmp_path / "wheels"
    empty.mkdir()
    done = _run_script(tmp_path / "out", "--smoke", wheels=str(empty))
    assert done.returncode == 3, done.stdout
    assert "no wheel of transformers 5.24.0" in done.stdout
    assert "make gpu-wheels" in done.stdout
    assert "make gpu-wheels" in (tmp_path / "out" / "gpu_run.log").read_text()


@pytest.mark.processes
def test_the_script_runs_a_smoke_section_end_to_end(tmp_path):
    """gpu_run.sh on this environment (GPU_WHEELS=none: its packages are installed): the
    environment lines, one real smoke section in its own process, the merged report and log."""
    out = tmp_path / "out"
    done = _run_script(out, "--smoke", "--sections", "tiers", "--device", "cpu", wheels="none")
    assert done.returncode == 0, done.stdout
    log = (out / "gpu_run.log").read_text()
    assert log == done.stdout
    assert f"torch {torch.__version__}" in log and "kernels: flash-attn" in log
    report = json.loads((out / "gpu_selfcheck.json").read_text())
    assert report["mode"] == "smoke" and list(report["sections"]) == ["tiers"]
    tiers = report["sections"]["tiers"]
    assert tiers["status"] == "ok" and tiers["exit_code"] == 0, tiers
    assert [row["config"] for row in tiers["rows"]] == ["resident", "host tier"]
    assert "## State tiers" in (out / "gpu_selfcheck.md").read_text()
    assert "gpu_run: exit 0" in log


# --- what travels --------------------------------------------------------------------------------


def test_the_carried_wheels_are_pinned_within_the_projects_ranges(bench_script):
    pins = bench_script("gpu_wheels").pinned((BENCH / "gpu_wheels.txt").read_text())
    assert {"transformers", "pydantic", "pydantic-core"} <= set(pins), pins
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    project = {Requirement(dep).name.lower(): Requirement(dep) for dep in deps}
    for name, version in pins.items():
        if name in project:  # transformers, pydantic: the versions the project is tested on
            assert project[name].specifier.contains(version), (name, version, project[name])


@pytest.mark.processes
def test_the_tracked_tree_leaves_room_for_the_wheels(bench_script):
    gpu_wheels = bench_script("gpu_wheels")
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no tracked tree to measure")
    room = gpu_wheels.TRAVEL_CAP_BYTES - gpu_wheels.WHEELS_CAP_BYTES
    assert gpu_wheels.tree_bytes(ROOT) <= room, "the tree and the wheels would pass 64 MiB"


def test_pinned_reads_the_requirements_file(bench_script):
    gpu_wheels = bench_script("gpu_wheels")
    text = textwrap.dedent("""\
        # comment==1
        pydantic==2.14.4 \\
            --hash=sha256:abc
        transformers==5.24.0
    """)
    assert gpu_wheels.pinned(text) == {"pydantic": "2.14.4", "transformers": "5.24.0"}
