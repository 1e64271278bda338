"""A user's checkpoint on a read-only volume (the documented Kubernetes layout): a run trains from
it without writing into it (its weights digest is recorded under the storage root), and what
one step writes fits the preflight's estimate of it."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from longstraw.models.checkpoint import METADATA_FILE, metadata_record_path, weights_digest_of
from longstraw.training.context import model_records
from longstraw.training.loop import train
from longstraw.training.preflight import check_prompts, preflight, step_write_bytes
from tests.training.helpers import run_config


def _listing(path: Path) -> list[tuple[str, int, int]]:
    return sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir())


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_run_from_a_read_only_model_directory_writes_nothing_into_it(tmp_path, checkpoint_dir):
    model = tmp_path / "models" / "user-qwen"
    shutil.copytree(checkpoint_dir("qwen3_5"), model)
    (model / METADATA_FILE).unlink()  # a user's checkpoint: no LongStraw record in it
    before = _listing(model)
    for path in [model, *model.iterdir()]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    # As root, permissions do not stop a write: then the listing comparison below is the test.
    read_only = not os.access(model, os.W_OK)
    try:
        config = run_config(
            tmp_path / "root",
            model,
            run_id="ro",
            num_steps=1,
            train={"groups_per_step": 2},
            persist_mode="synchronous",
        )
        preflight(config, resume=False)
        estimate = step_write_bytes(config, check_prompts(config))
        outcome = train(config)
    finally:
        for path in [model, *model.iterdir()]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    assert outcome.policy_version == 1
    assert _listing(model) == before, "the run wrote into the model directory"
    record = metadata_record_path(model, model_records(config))
    assert record.is_file() and weights_digest_of(model) in record.read_text()
    assert read_only or os.geteuid() == 0
    # The step's writes (prompt states, checkpoint, records) stay within the estimate, which is
    # not a vacuous bound either (measured: 1.09x the tiny run's bytes).
    written = _bytes_under(outcome.run_path)
    assert written <= sum(estimate.values()) <= 2 * written, (written, estimate)
    states = _bytes_under(outcome.run_path / "policy-v0")
    assert states <= estimate["prompt states"] <= 2 * states, (states, estimate)
