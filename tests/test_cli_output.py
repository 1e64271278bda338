"""What `longstraw train` prints when its output is piped (CI logs, `| tee`): one step of the
hybrid tiny model (full attention + Gated DeltaNet) on CPU, `--no-prefect`, read line by line."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from longstraw.schemas.data import HaystackTaskConfig

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[1]
LONG_NAME = "a-storage-root-whose-name-alone-is-longer-than-the-eighty-columns-of-a-pipe-x"


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory, checkpoint_dir) -> subprocess.CompletedProcess:
    tmp = tmp_path_factory.mktemp("piped")
    config = {
        "run_id": "piped",
        "model": {"checkpoint": str(checkpoint_dir("qwen3_5"))},
        "engine": {"shard_tokens": 24},
        "train": {"num_steps": 1, "groups_per_step": 1},
        "grpo": {"num_generations": 2, "max_completion_length": 2},
        "data": {
            "type": "haystack",
            "task": HaystackTaskConfig.tiny(num_prompt_tokens=63).model_dump(mode="json"),
        },
        # Longer than the 80 columns rich gives a pipe.
        "storage": {"root_uri": str(tmp / LONG_NAME), "persist_mode": "off"},
    }
    (tmp / "run.yaml").write_text(yaml.safe_dump(config))
    # This checkout's code, and a user's shell: rich's width from the pipe (no COLUMNS), and
    # transformers at its own verbosity (tests/conftest.py quiets it for this process).
    unset = ("COLUMNS", "LINES", "TRANSFORMERS_VERBOSITY")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "longstraw.cli", "train", "--config", "run.yaml", "--no-prefect"],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_paths_arrive_whole_on_one_line_when_output_is_piped(piped_run):
    lines = piped_run.stdout.splitlines()
    storage = [line for line in lines if line.startswith("LongStraw run piped:")]
    assert len(storage) == 1 and storage[0].endswith(f"/{LONG_NAME}"), lines
    finished = [line for line in lines if line.startswith("finished in ")]
    assert len(finished) == 1, lines
    checkpoint = finished[0].split("latest checkpoint: ", 1)[1]
    assert checkpoint.endswith(f"/{LONG_NAME}/runs/piped/checkpoints/v000001"), lines


def test_missing_kernels_are_named_once_and_transformers_fallbacks_not_at_all(piped_run):
    lines = (piped_run.stdout + piped_run.stderr).splitlines()
    assert not [line for line in lines if "falling back" in line], lines
    missing = [
        dist
        for module, dist in (
            ("flash_attn", "flash-attn"),
            ("fla", "flash-linear-attention"),
            ("causal_conv1d", "causal-conv1d"),
        )
        if importlib.util.find_spec(module) is None
    ]
    named = [line for line in lines if "[gpu]" in line]
    if missing:
        assert len(named) == 1, lines
        assert all(dist in named[0] for dist in missing), named
    else:
        assert named == [], lines


def test_the_summary_table_keeps_its_layout_when_output_is_piped(piped_run):
    lines = piped_run.stdout.splitlines()
    title = next(line for line in lines if "LongStraw training summary" in line)
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 1, lines
    # Centred above the table, as on a terminal.
    assert title.index("LongStraw") > 0, lines
    assert len(title.rstrip()) < len(rows[0]), lines
