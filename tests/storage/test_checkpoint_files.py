"""A committed checkpoint's files: readable by group and others as the umask allows."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from longstraw.models.checkpoint import load_checkpoint
from longstraw.schemas.storage import StorageConfig
from longstraw.storage.checkpoints import save_training_checkpoint


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_checkpoint_files_take_the_mode_the_umask_gives(checkpoint_dir, tmp_path, umask, mode):
    model, tokenizer, _ = load_checkpoint(checkpoint_dir("llama"), dtype=torch.float32)
    storage = StorageConfig(root_uri=str(tmp_path))
    previous = os.umask(umask)
    try:
        ref = save_training_checkpoint(
            storage,
            "modes",
            policy_version=1,
            model=model,
            tokenizer=tokenizer,
            optimizer_tensors={"exp_avg/w": torch.ones(3)},
            trainer_state={"step": 0},
        )
    finally:
        os.umask(previous)
    folder = ref.uri.removeprefix("file://")
    files = {
        name: stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode)
        for name in os.listdir(folder)
    }
    # safetensors alone writes 0600: the weights and the optimizer state are the files at stake.
    assert {"model.safetensors", "optimizer.safetensors", "trainer_state.json"} <= set(files)
    assert files == dict.fromkeys(files, mode), files
