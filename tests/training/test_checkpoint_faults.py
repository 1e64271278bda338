"""Faults around checkpoints, in process: a damaged or truncated checkpoint is named and never
used (`--resume` falls back to the one before it), a kill between a checkpoint's commit and its
metrics row loses no row, a crash before the first checkpoint resumes from the initial weights
reusing the committed shards, and `state gc` removes half-written checkpoint directories."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil

import pytest
from typer.testing import CliRunner

from longstraw.models.checkpoint import CheckpointDamagedError
from longstraw.storage.checkpoints import (
    checkpoint_path,
    latest_checkpoint,
    latest_valid_checkpoint,
    valid_checkpoint,
)
from longstraw.storage.state_commands import state_app
from longstraw.training.loop import read_metrics, train
from longstraw.training.run_stage import forget_everything
from longstraw.training.step import IN_PROCESS
from tests.training.helpers import algorithm_fields, run_config

# The run-based tests share one 2-step run (~1 min on 2 busy cores) and each run steps more.
NUM_STEPS = 2
SHARDS_PER_STEP = 3
"""1 group × 3 shards of a 63-token state (run_config)."""


class Killed(KeyboardInterrupt):
    """What a SIGKILL at this point would leave: nothing after it runs (not even `finally`
    blocks that write, since none write after the point these tests stop at)."""


@pytest.fixture(scope="module")
def whole(tmp_path_factory, checkpoint_dir):
    """The uninterrupted run: (config, final weights digest, metrics rows)."""
    root = tmp_path_factory.mktemp("faults")
    config = run_config(
        root,
        checkpoint_dir("qwen3_5"),
        run_id="whole",
        num_steps=NUM_STEPS,
        data={"rewards": ["tests.training.helpers:checksum_reward"]},
        train={"groups_per_step": 1},
    )
    outcome = train(config)
    assert all(m.grad_norm > 0 for m in outcome.history), "zero gradient: digests cannot differ"
    return config, outcome.checkpoint_digest, read_metrics(outcome.run_path)


def _flip_byte(path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_damaged_or_truncated_files_are_named(whole, tmp_path):
    config, _, _ = whole
    source = checkpoint_path(config.storage, "whole", 1)
    damaged = shutil.copytree(source, tmp_path / "v000001")
    valid_checkpoint(damaged)  # the copy verifies
    _flip_byte(damaged / "model.safetensors")
    with pytest.raises(CheckpointDamagedError, match=r"model\.safetensors has sha256 .* written"):
        valid_checkpoint(damaged)
    truncated = shutil.copytree(source, tmp_path / "v000002")
    with open(truncated / "optimizer.safetensors", "r+b") as handle:
        handle.truncate(1000)
    with pytest.raises(CheckpointDamagedError, match=r"optimizer\.safetensors has 1000 bytes"):
        valid_checkpoint(truncated)
    (truncated / "optimizer.safetensors").unlink()
    with pytest.raises(CheckpointDamagedError, match=r"optimizer\.safetensors is missing"):
        valid_checkpoint(truncated)


@pytest.mark.slow
def test_resume_sets_a_damaged_checkpoint_aside_and_ends_on_the_same_weights(whole, caplog):
    config, digest, rows = whole
    latest = latest_checkpoint(config.storage, "whole")
    assert latest is not None and latest.name == "v000002"
    _flip_byte(latest / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="longstraw.checkpoints"):
        resumed = train(config, resume=True)
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "v000002 is damaged (model.safetensors has sha256" in warning, warning
    assert len(list(latest.parent.glob("v000002.damaged-*"))) == 1  # kept for inspection
    # Step 1 ran again from v000001: the same weights as the uninterrupted run, bitwise.
    assert [m.step for m in resumed.history] == [1]
    assert resumed.checkpoint_digest == digest
    assert latest_valid_checkpoint(config.storage, "whole") == latest
    assert [algorithm_fields(m) for m in read_metrics(resumed.run_path)] == [
        algorithm_fields(m) for m in rows
    ]


@pytest.mark.slow
def test_kill_between_checkpoint_and_metrics_row_loses_no_row(whole):
    config, digest, rows = whole
    config = config.model_copy(update={"run_id": "metrics-kill"})

    def record_step_killed_at_last_step(config, metrics):
        if metrics.step == NUM_STEPS - 1:
            raise Killed
        return IN_PROCESS.record_step(config, metrics)

    stages = dataclasses.replace(IN_PROCESS, record_step=record_step_killed_at_last_step)
    with pytest.raises(Killed):
        train(config, stages=stages)
    run_path = checkpoint_path(config.storage, "metrics-kill", 0).parents[1]
    assert latest_checkpoint(config.storage, "metrics-kill").name == f"v{NUM_STEPS:06d}"
    assert [m.step for m in read_metrics(run_path)] == list(range(NUM_STEPS - 1))

    resumed = train(config, resume=True)
    assert resumed.history == []  # nothing left to run
    assert resumed.checkpoint_digest == digest
    restored = read_metrics(run_path)
    assert [algorithm_fields(m) for m in restored] == [algorithm_fields(m) for m in rows]
    assert "checkpoint" not in restored[-1].seconds  # recorded before the checkpoint was timed


@pytest.mark.slow
def test_crash_before_the_first_checkpoint_resumes_from_the_initial_weights(whole):
    config, digest, _ = whole
    config = config.model_copy(
        update={
            "run_id": "early-crash",
            "storage": config.storage.model_copy(update={"persist_mode": "synchronous"}),
        }
    )

    def backward_killed(*args, **kwargs):
        raise Killed

    with pytest.raises(Killed):
        train(config, stages=dataclasses.replace(IN_PROCESS, backward_group=backward_killed))
    assert latest_checkpoint(config.storage, "early-crash") is None
    forget_everything(config)  # what a new process knows: storage only

    resumed = train(config, resume=True)
    first = resumed.history[0]
    assert (first.step, first.shards_computed, first.shards_reused) == (0, 0, SHARDS_PER_STEP)
    assert resumed.checkpoint_digest == digest


def test_state_gc_removes_half_written_checkpoints(tmp_path):
    leftover = tmp_path / "runs" / "r" / "checkpoints" / "v000003.tmp-0badc0de"
    leftover.mkdir(parents=True)
    (leftover / "optimizer.safetensors").write_bytes(b"x" * 2048)
    committed = leftover.with_name("v000002")
    committed.mkdir()
    old = leftover.stat().st_mtime - 7200
    os.utime(leftover / "optimizer.safetensors", (old, old))

    runner = CliRunner()  # not a terminal: the table is as wide as its rows (paths whole)
    listed = runner.invoke(state_app, ["gc", str(tmp_path), "--dry-run", "--locks-dir", "x"])
    assert listed.exit_code == 0, listed.output
    assert "v000003.tmp-0badc0de" in listed.output and leftover.exists()
    fresh = runner.invoke(state_app, ["gc", str(tmp_path), "--grace-seconds", "99999"])
    assert "v000003.tmp" not in fresh.output and leftover.exists()
    removed = runner.invoke(state_app, ["gc", str(tmp_path), "--locks-dir", "x"])
    assert removed.exit_code == 0, removed.output
    assert "half-written" in removed.output
    assert not leftover.exists() and committed.is_dir()
