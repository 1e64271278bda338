"""The CLI answers before it imports the heavy stack: `--help` of every command, every config
error and the schemas' validation leave torch, transformers and Prefect unimported.

Checked in a fresh interpreter (this test process has them all loaded): it imports the CLI,
validates every example config, then runs each command line in turn and reports which of the
heavy modules are in `sys.modules` after each, so a failure names the command that pulled one
in. The times these save are measured by bench/bench_cli_startup.py (docs/operations.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from longstraw.cli import app

pytestmark = pytest.mark.processes  # a fresh interpreter

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "prefect")

PROBE = """
import json, sys
from pathlib import Path

heavy = lambda: sorted(m for m in {heavy} if m in sys.modules)
report = []
from longstraw.cli import app
report.append(["import longstraw.cli", 0, heavy()])
from longstraw.schemas.overrides import RunConfigOverrides
from longstraw.schemas.run import command_line_config
for example in sorted(Path({examples!r}).glob("*.yaml")):
    command_line_config(example, {{"train.num_steps": 1}})
report.append(["validate examples/*.yaml", 0, heavy()])
for args in json.loads(Path(sys.argv[1]).read_text()):
    try:
        code = app(args, prog_name="longstraw", standalone_mode=False)
    except SystemExit as exit:
        code = exit.code
    report.append([" ".join(args), code or 0, heavy()])
Path(sys.argv[2]).write_text(json.dumps(report))
"""


def _command_paths(command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and group under `command` (a click command: typer carries its own click),
    as the words that name it."""
    paths = [path]
    for name, sub in getattr(command, "commands", {}).items():
        paths += _command_paths(sub, (*path, name))
    return paths


def _config_errors(tmp_path: Path) -> list[list[str]]:
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: {epsilon: 2.0}\n")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    untagged = tmp_path / "untagged.yaml"
    untagged.write_text("data: {num_prompts: 5}\n")
    return [
        ["train", "--config", str(tmp_path / "missing.yaml")],
        ["train", "--config", str(bad)],
        ["train", "--config", str(empty)],
        ["train", "--config", str(untagged)],
        ["train", "--steps", "0"],
        ["train", "--world-size", "3", "--data-parallel", "2"],
        ["train", "--config", str(ROOT / "examples" / "run.yaml"), "--root", "ftp://host/x"],
    ]


def test_help_and_config_errors_import_no_torch_transformers_or_prefect(tmp_path):
    helps = [[*path, "--help"] for path in _command_paths(typer.main.get_command(app))]
    assert ["train", "--help"] in helps and ["state", "ls", "--help"] in helps, helps
    errors = _config_errors(tmp_path)
    (tmp_path / "args.json").write_text(json.dumps(helps + errors))
    probe = PROBE.format(heavy=HEAVY, examples=str(ROOT / "examples"))
    subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "args.json"), str(tmp_path / "report.json")],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=120,
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report) == 2 + len(helps) + len(errors)
    first = next(((line, modules) for line, _, modules in report if modules), None)
    assert first is None, f"`{first[0]}` imported {first[1]} (the first step that did)"
    codes = {line: code for line, code, _ in report[2:]}
    assert all(codes[" ".join(args)] == 0 for args in helps), codes
    assert all(codes[" ".join(args)] == 2 for args in errors), codes
    # Nothing was started or written on the way to the error (no ./.longstraw, no Prefect home).
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["args.json", "report.json", "bad.yaml", "empty.yaml", "untagged.yaml"]
    )
