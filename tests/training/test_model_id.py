"""`model.checkpoint` as a Hugging Face model id: resolved offline from the local hub cache
(`HF_HUB_CACHE`), trained like a user's directory, and refused in one line when it is not there."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest

from longstraw.errors import UserError
from longstraw.models.checkpoint import METADATA_FILE, metadata_record_path, weights_digest_of
from longstraw.models.hub import looks_like_model_id
from longstraw.schemas.run import RunConfig
from longstraw.storage.checkpoints import latest_checkpoint
from longstraw.training.context import model_records
from longstraw.training.loop import train
from longstraw.training.preflight import preflight
from tests.training.helpers import run_config

MODEL_ID = "tiny-org/tiny-qwen3_5"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def _cache_entry(cache: Path, checkpoint: Path) -> Path:
    """Lay `checkpoint` out as `hf download` does: blobs named by content hash, the snapshot's
    files linked to them, `refs/main` naming the snapshot's commit. Returns the snapshot."""
    repo = cache / f"models--{MODEL_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(checkpoint.iterdir()):
        if file.name == METADATA_FILE:
            continue  # a model from the Hub carries no LongStraw record
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test: the lookup must be offline."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_a_model_id_in_the_local_cache_trains_and_resumes(
    tmp_path, checkpoint_dir, monkeypatch, no_network
):
    snapshot = _cache_entry(tmp_path / "hub", checkpoint_dir("qwen3_5"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # offline by construction, not by setting

    # beta > 0: the reference model is the run's initial checkpoint, resolved again on resume.
    def config_of(num_steps: int) -> RunConfig:
        # One shard, one group of two, detached: the checkpoint's path is under test, not the
        # gradient (about 2 s a step on 2 cores instead of 10-20 s for the helpers' default).
        return run_config(
            tmp_path / "root",
            Path(MODEL_ID),
            run_id="hub",
            num_steps=num_steps,
            grpo={"beta": 0.04, "num_generations": 2},
            task={"num_prompt_tokens": 40},
            train={"groups_per_step": 1},
            engine={"prompt_grad": "detached", "shard_tokens": 39},
        )

    config = config_of(1)
    assert config.model.checkpoint == MODEL_ID
    preflight(config, resume=False)
    first = train(config)
    assert first.policy_version == 1
    # The run started from the snapshot, and recorded its digest under the storage root.
    start = metadata_record_path(snapshot, model_records(config))
    assert start.is_file() and weights_digest_of(snapshot) in start.read_text()
    assert not (snapshot / METADATA_FILE).exists()
    resumed = train(config_of(2), resume=True)
    assert resumed.policy_version == 2 and [m.step for m in resumed.history] == [1]
    final = latest_checkpoint(config.storage, "hub")
    assert final is not None and final.name == "v000002"
    assert (final / "tokenizer.json").read_bytes() == (snapshot / "tokenizer.json").read_bytes()


def test_a_model_id_missing_from_the_cache_is_one_line_naming_the_cache(
    tmp_path, monkeypatch, no_network
):
    (tmp_path / "hub").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    config = RunConfig.model_validate(
        {"model": {"checkpoint": "Qwen/Qwen3-0.6B"}, "storage": {"root_uri": str(tmp_path)}}
    )
    with pytest.raises(UserError) as error:
        preflight(config, resume=False)
    message = error.value.one_line()
    assert message.startswith(
        "model.checkpoint Qwen/Qwen3-0.6B is neither a directory nor a model in the Hugging Face "
        f"cache {tmp_path / 'hub'} "
    ), message
    assert "hf download Qwen/Qwen3-0.6B" in message and " — " in message


def test_paths_are_never_taken_for_model_ids():
    assert looks_like_model_id("Qwen/Qwen3-0.6B") and looks_like_model_id("gpt2")
    for path in ("/models/qwen", "./qwen", "~/qwen", "../qwen", "a/b/c", "qwen dir"):
        assert not looks_like_model_id(path), path
