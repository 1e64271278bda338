"""The `tracking` section, the preflight's line for a missing tracker package, the metric names
(against docs/operations.md), the step numbers the trackers add, the completions table, and the
W&B run-file reader on records that span blocks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longstraw.errors import UserError
from longstraw.schemas.refs import PromptRef, RolloutRecord
from longstraw.schemas.results import GroupStats
from longstraw.schemas.run import ConfigError, RunConfig, validated_run_config
from longstraw.trackers import run_trackers
from longstraw.trackers.completions import completion_rows, cut
from longstraw.trackers.metric_names import (
    EVAL_NAMES,
    LONGSTRAW_NAMES,
    SECONDS_PREFIX,
    TRL_NAMES,
    tracker_metrics,
)
from longstraw.trackers.tracker import markdown_table
from longstraw.training.preflight import preflight
from longstraw.training.step import completion_lengths, step_metrics

REPO = Path(__file__).resolve().parents[2]


def _config(tracking: dict) -> RunConfig:
    return validated_run_config({"tracking": tracking}, "test")


def test_report_to_takes_a_list_a_single_name_or_none():
    assert _config({"report_to": ["wandb", "mlflow"]}).tracking.report_to == ["wandb", "mlflow"]
    assert _config({"report_to": "tensorboard"}).tracking.report_to == ["tensorboard"]
    assert _config({"report_to": "none"}).tracking.report_to == []
    assert RunConfig().tracking.report_to == []


@pytest.mark.parametrize(
    ("tracking", "message"),
    [
        ({"report_to": ["comet"]}, "tracking.report_to.0: Input should be 'tensorboard'"),
        ({"report_to": ["wandb", "wandb"]}, "wandb named more than once"),
        ({"completions_per_step": -1}, "tracking.completions_per_step"),
        ({"project": "a/b"}, "tracking.project"),
    ],
)
def test_bad_tracking_settings_name_the_field(tracking, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _config(tracking)


def test_preflight_names_the_pip_install_of_a_missing_tracker(
    tmp_path, monkeypatch, checkpoint_dir
):
    config = validated_run_config(
        {
            "model": {"checkpoint": str(checkpoint_dir("llama"))},
            "storage": {"root_uri": str(tmp_path)},
            "tracking": {"report_to": ["tensorboard", "wandb"]},
        },
        "test",
    )
    preflight(config, resume=False)  # both installed (the dev extra)
    real = run_trackers.importlib.util.find_spec
    monkeypatch.setattr(
        run_trackers.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else real(name, *a),
    )
    with pytest.raises(UserError) as error:
        preflight(config, resume=False)
    assert str(error.value) == (
        "tracking.report_to names wandb but the wandb package is not installed — pip install "
        "wandb (or pip install 'longstraw[trackers]' for every tracker), or remove wandb from "
        "tracking.report_to"
    )
    assert not (tmp_path / "runs").exists()


def test_metric_names_are_the_documented_ones():
    text = (REPO / "docs" / "operations.md").read_text()
    section = text[text.index("## Experiment trackers") : text.index("## Faults and what")]
    documented = re.findall(r"^\| `([^`]+)` \|", section, flags=re.MULTILINE)
    assert documented == [*TRL_NAMES, *LONGSTRAW_NAMES, *EVAL_NAMES, SECONDS_PREFIX + "<stage>"]


def _record(rewards: list[float], lengths: list[int], masks=None, index=0) -> RolloutRecord:
    prompt = PromptRef(
        index=index,
        prompt_id="p",
        prompt_digest="ab" * 32,
        num_tokens=4,
        num_shards=1,
        policy_version=0,
        weights_digest="w",
    )
    return RolloutRecord(
        prompt=prompt,
        response_ids=[[7] * n for n in lengths],
        sampler_logprobs=[[0.0] * n for n in lengths],
        texts=["x" * n for n in lengths],
        truncated=[False] * len(lengths),
        rewards=rewards,
        loss_masks=masks,
    )


def _stats(state_bytes: int) -> GroupStats:
    return GroupStats(
        prompt_grad="exact",
        loss=0.0,
        branch_losses=[],
        branch_logprobs=[],
        num_tokens=[],
        prompt_tokens=4,
        num_shards=1,
        state_bytes=state_bytes,
    )


def test_step_numbers_for_the_trackers():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.5, 1.0], [0.2, 0.2, 0.2]], dtype=torch.float64)
    records = [
        _record([1.0, 1.0, 1.0], [1, 2, 3]),
        # An agent trajectory: its masked (given) tokens are not the policy's completion.
        _record([0.0, 0.5, 1.0], [4, 4, 4], masks=[[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]]),
        _record([0.2, 0.2, 0.2], [5, 6, 7]),
    ]
    lengths = [n for r in records for n in completion_lengths(r)]
    assert lengths == [1, 2, 3, 2, 4, 0, 5, 6, 7]
    metrics = step_metrics(
        step=0,
        policy_version=0,
        rewards=rewards,
        advantages=torch.zeros(3, 3, dtype=torch.float64),
        group_stats=[_stats(10), _stats(30), _stats(20)],
        update=type("U", (), {"grad_norm": 0.0, "learning_rate": 0.0})(),
        prompt_tokens=12,
        num_items=30,
        truncated=[False] * 9,
        seconds={"prefill": 1.5, "replay": 2.0},
        shards_computed=3,
        shards_reused=0,
        completion_lengths=lengths,
    )
    assert metrics.frac_reward_zero_std == 2 / 3
    assert metrics.reward_std == float(rewards.flatten().std())
    assert (metrics.completion_length_min, metrics.completion_length_max) == (0, 7)
    assert metrics.completion_length_mean == sum(lengths) / 9
    assert metrics.state_bytes == 30
    values = tracker_metrics(metrics, agent=False)
    assert values["frac_reward_zero_std"] == 2 / 3 and values["completions/max_length"] == 7.0
    assert values["longstraw/seconds/total"] == 3.5 and values["longstraw/state_bytes"] == 30
    # Not measured: not logged (beta = 0, no state budget, not an agent run).
    assert not {"kl", "longstraw/state_peak_resident_bytes", "longstraw/turns_mean"} & set(values)


def test_completions_table_rows_and_cut():
    # Two groups of a step whose prompts are the run's 6th and 7th: numbered run-wide.
    records = [_record([0.0, 1.0], [3, 300], index=5), _record([0.5, 0.5], [1, 1], index=6)]
    rows = completion_rows(records, [[-1.0, 1.0], [0.0, 0.0]], rows=3, chars=10)
    assert rows == [
        [5, "p", "abababababab", 0, "xxx", 0.0, -1.0],
        [5, "p", "abababababab", 1, "x" * 9 + "…", 1.0, 1.0],
        [6, "p", "abababababab", 0, "x", 0.5, 0.0],
    ]
    assert cut("abc", 3) == "abc" and cut("abcd", 3) == "ab…"
    assert markdown_table(["a", "b"], [["x|y\nz", 0.123456]]).splitlines() == [
        "| a | b |",
        "|---|---|",
        "| x\\|y z | 0.1235 |",
    ]


WANDB_WRITER = """
import sys, wandb
run = wandb.init(project="p", id="r1", dir=sys.argv[1], mode="offline",
                 settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
run.log({"text": "y" * 100000, "reward": 0.25}, step=0)
run.log({"reward": 0.5}, step=1)
run.finish()
"""


@pytest.mark.processes
def test_wandb_run_file_reader_reads_records_that_span_blocks(tmp_path):
    pytest.importorskip("wandb", reason="pip install 'longstraw[trackers]'")
    from longstraw.trackers.wandb_files import history, run_files

    subprocess.run([sys.executable, "-c", WANDB_WRITER, str(tmp_path)], check=True, timeout=120)
    (path,) = run_files(tmp_path, "r1")
    assert path.stat().st_size > 3 * 32768  # the first row spans blocks
    rows = history(tmp_path, "r1")
    assert [(step, values["reward"]) for step, values in rows] == [(0, 0.25), (1, 0.5)]
    assert rows[0][1]["text"] == "y" * 100000


def test_a_row_recorded_before_the_new_numbers_leaves_them_out():
    from longstraw.schemas.results import StepMetrics

    old = StepMetrics.model_validate(
        {
            "step": 0,
            "policy_version": 0,
            "reward_mean": 0.5,
            "reward_std": 0.1,
            "advantage_mean": 0.0,
            "advantage_std": 1.0,
            "advantage_min": -1.0,
            "advantage_max": 1.0,
            "loss": 0.0,
        }
    )
    values = tracker_metrics(old, agent=False)
    assert values["reward"] == 0.5
    assert not {"frac_reward_zero_std", "completions/mean_length", "longstraw/state_bytes"} & set(
        values
    )
