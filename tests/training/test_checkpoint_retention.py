"""`train.save_total_limit`: the latest N checkpoints (and optionally the best by reward), the
optimizer state only in the latest, and a resume from what is left."""

from __future__ import annotations

import json

from longstraw.storage.checkpoints import OPTIMIZER_FILE, checkpoints_dir, valid_checkpoint
from longstraw.training.loop import train
from tests.training.helpers import run_config

CHECKSUM_REWARD = "tests.training.helpers:checksum_reward"


def test_save_total_limit_keeps_latest_and_best_and_optimizer_only_in_latest(
    tmp_path, checkpoint_dir
):
    config = run_config(
        tmp_path,
        checkpoint_dir("qwen3_5"),
        run_id="retained",
        num_steps=4,
        data={"rewards": [CHECKSUM_REWARD]},
        train={"groups_per_step": 1, "save_total_limit": 2, "keep_best_checkpoint": True},
    )
    history = train(config).history
    folder = checkpoints_dir(config.storage, config.run_id)
    # A step's rollouts measure the version it started from; checkpoint v(step + 1) follows it.
    # The best is judged over the steps recorded before the latest checkpoint was written.
    best = max(history[:-1], key=lambda m: m.reward_mean).policy_version
    expected = sorted({f"v{v:06d}" for v in (3, 4, best) if v > 0})
    assert sorted(p.name for p in folder.iterdir()) == expected, [m.reward_mean for m in history]
    assert (folder / "v000004" / OPTIMIZER_FILE).is_file()
    # Weights-only checkpoints still verify (their file record lost the optimizer's entry).
    for path in folder.iterdir():
        valid_checkpoint(path)
    for name in expected[:-1]:
        assert not list((folder / name).glob("optimizer*")), name
        assert (folder / name / "model.safetensors").is_file(), name

    # A resume starts from the latest, which kept its optimizer state.
    more = config.model_copy(update={"train": config.train.model_copy(update={"num_steps": 5})})
    resumed = train(more, resume=True).history
    assert [m.step for m in resumed] == [4]
    state = json.loads((folder / "v000005" / "trainer_state.json").read_text())
    assert state["step"] == 5  # steps done
    assert not (folder / "v000004" / OPTIMIZER_FILE).exists()
