"""A reward that returns NaN, inf or a non-number, or raises, ends the run in one `error:` line
naming the reward, the sample, the prompt (id, group, step) and the value; `--debug` keeps the
reward's own traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from longstraw.grpo.rewards import RewardError, score_group

REPO = Path(__file__).resolve().parents[2]
WHERE = "prompt 'q7' (group 1 of step 3)"


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (float("nan"), "returned nan"),
        (float("-inf"), "returned -inf"),
        ("0.5", "returned '0.5' (str)"),
    ],
)
def test_a_bad_reward_value_names_the_reward_sample_prompt_and_value(value, shown):
    def picky(prompt, response, metadata):
        return value if response == "b" else 1.0

    with pytest.raises(RewardError) as error:
        score_group([picky], None, "p", ["a", "b"], {}, where=WHERE)
    message = error.value.one_line()
    assert f"'{picky.__module__}.{picky.__qualname__}' {shown}" in message, message
    assert f"for sample 1 of {WHERE}" in message and " — fix the reward function" in message


def test_a_raising_reward_is_named_and_keeps_its_exception_as_the_cause():
    def boom(prompt, response, metadata):
        raise KeyError("answer")

    with pytest.raises(RewardError) as error:
        score_group([boom], None, "p", ["a"], {}, where=WHERE)
    message = error.value.one_line()
    assert "raised KeyError: 'answer' on sample 0 of prompt 'q7' (group 1 of step 3)" in message
    # What --debug prints: the traceback runs through the reward function itself.
    assert isinstance(error.value.__cause__, KeyError)
    assert error.value.__cause__.__traceback__.tb_next.tb_frame.f_code.co_name == "boom"


@pytest.mark.processes
def test_train_ends_in_one_error_line_when_a_reward_returns_nan(tmp_path, checkpoint_dir):
    (tmp_path / "nan_reward.py").write_text(
        textwrap.dedent(
            """
            def nan_reward(prompt, response, metadata):
                return float("nan")
            """
        )
    )
    config = {
        "run_id": "nan",
        "model": {"checkpoint": str(checkpoint_dir("llama"))},
        "train": {"num_steps": 1, "groups_per_step": 1},
        "grpo": {"num_generations": 2, "max_completion_length": 2},
        "data": {"type": "haystack", "rewards": ["nan_reward:nan_reward"]},
        "storage": {"root_uri": str(tmp_path / "root"), "persist_mode": "off"},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    path = os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "longstraw.cli", "train", "--config", "run.yaml", "--no-prefect"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0] == (
        "error: reward function 'nan_reward:nan_reward' returned nan for sample 0 of prompt "
        "'haystack-42' (group 0 of step 0); rewards must be finite — fix the reward function: "
        "it must return a finite number for every response"
    )
