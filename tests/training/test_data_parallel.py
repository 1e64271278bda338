"""`parallel.data_parallel: 2`: a step's groups spread over two replicas of the sequence-sharded
engine (one rank each, then two ranks each) train what one process trains on the same groups and
seeds — four groups (two each), three (two and one) and one (the other replica idle) —, for
`loss_type` grpo and dapo with a KL term and two updates per rollout; a replica killed
mid-step leaves a run that `--resume` finishes with the same checkpoint, recomputing neither the
committed prompt states nor the groups that had finished.

Legend: the tiny qwen3_5 hybrid, a 64-token prompt (63 state tokens in 3 shards of 23), exact
prompt gradient, G = 3, group i of a step on replica i mod 2.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import yaml

from longstraw.distributed.stage_group import start_stage_group, stop_stage_group
from longstraw.schemas.refs import BackwardResult
from longstraw.storage.checkpoints import latest_checkpoint, run_dir
from longstraw.training.loop import train
from longstraw.training.metrics import read_metrics
from tests.training.helpers import run_config, small_haystack_task
from tests.training.test_world_size import (
    ADAM_EPSILON,
    _assert_same_checkpoint,
    _env,
    _kill_spawned_ranks_when,
    _train,
)

pytestmark = [pytest.mark.processes, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
GROUPS = 4
CASES = {"grpo": ("grpo", GROUPS), "dapo-uneven": ("dapo", 3), "one-group": ("dapo", 1)}
"""Run id -> (loss type, groups per step): the step's groups split evenly over two replicas,
unevenly (2 + 1), and onto one replica while the other has none (that run also evaluates
held-out prompts after its step)."""


HELD_OUT = {
    "type": "haystack",
    "rewards": ["tests.training.helpers:checksum_reward"],
    "num_prompts": 2,
    "task": small_haystack_task(seed=1000),
}
"""Held-out prompts the one-group case evaluates after its step (on replica 0's ranks)."""


def _config(root: Path, checkpoint: Path, case: str, run_id: str | None = None):
    config = _training_config(root, checkpoint, case, run_id)
    if case != "one-group":
        return config
    raw = config.model_dump(mode="json")
    raw["train"]["eval_steps"] = 1
    raw["eval"] = {"data": HELD_OUT}
    return type(config).model_validate(raw)


def _training_config(root: Path, checkpoint: Path, case: str, run_id: str | None):
    loss_type, groups = CASES[case]
    return run_config(
        root,
        checkpoint,
        run_id=run_id or case,
        num_steps=1,
        grpo={
            "num_generations": 3,
            "beta": 0.04,
            "num_iterations": 2,
            "loss_type": loss_type,
            "adam_epsilon": ADAM_EPSILON,
        },
        train={"groups_per_step": groups},
        data={"rewards": ["tests.training.helpers:checksum_reward"]},
        persist_mode="synchronous",
    )


def _with_replicas(config, sequence_ranks: int, replicas: int = 2):
    parallel = config.parallel.model_copy(
        update={
            "world_size": replicas * sequence_ranks,
            "data_parallel": replicas,
            "timeout_s": 120,
        }
    )
    return config.model_copy(update={"parallel": parallel})


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, checkpoint_dir):
    """case -> (config, final checkpoint, metrics): the runs in one process."""
    out = {}
    for case in CASES:
        config = _config(tmp_path_factory.mktemp("one"), checkpoint_dir("qwen3_5"), case)
        history = train(config).history
        assert history[0].grad_norm > 0, "nothing trained: no signal to compare"
        out[case] = (config, latest_checkpoint(config.storage, config.run_id), history)
    return out


def _assert_same_metrics(history, reference) -> None:
    assert len(history) == len(reference)
    for two, one in zip(history, reference, strict=True):
        for field in ("step", "policy_version", "num_groups", "completion_tokens"):
            assert getattr(two, field) == getattr(one, field), field
        for field in ("reward_mean", "reward_std", "advantage_mean", "advantage_std"):
            assert getattr(two, field) == getattr(one, field), field
        assert two.loss == pytest.approx(one.loss, rel=1e-4, abs=1e-7)
        assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-4)
        assert two.kl == pytest.approx(one.kl, rel=1e-3, abs=1e-8)


def _replica_of_each_group(config) -> dict[int, int]:
    """Prompt index -> the replica whose ranks wrote its first backward's gradient."""
    out = {}
    for path in run_dir(config.storage, config.run_id).rglob("finished/g*-i0-backward.json"):
        (record,) = json.loads(path.read_text())
        result = BackwardResult(**record["result"])
        out[int(path.name.split("-")[0][1:])] = result.grad.replica
    return out


@pytest.mark.parametrize("sequence_ranks", [1, 2], ids=["R2xS1", "R2xS2"])
def test_two_replicas_train_what_one_process_trains(
    sequence_ranks, tmp_path, checkpoint_dir, single_process
):
    """Every case on one rank group (its processes started once): the final weights per tensor
    within 1e-5 of the single process's, the step's metrics equal, and the groups spread over
    the replicas as documented."""
    configs = [
        _with_replicas(_config(tmp_path / case, checkpoint_dir("qwen3_5"), case), sequence_ranks)
        for case in CASES
    ]
    start_stage_group(configs[0].parallel)
    try:
        histories = [train(config).history for config in configs]
    finally:
        stop_stage_group()
    for config, history in zip(configs, histories, strict=True):
        _, reference_checkpoint, reference = single_process[config.run_id]
        _assert_same_checkpoint(
            latest_checkpoint(config.storage, config.run_id),
            reference_checkpoint,
            checkpoint_dir("qwen3_5"),
        )
        _assert_same_metrics(history, reference)
        assert [m.eval for m in history] == [m.eval for m in reference]
        assert (config.eval is None) == (history[-1].eval is None), "no evaluation to compare"
        groups = config.train.groups_per_step
        assert _replica_of_each_group(config) == {g: g % 2 for g in range(groups)}


def test_replica_killed_mid_step_then_resume_on_the_flow_recomputes_only_unfinished_groups(
    tmp_path, checkpoint_dir, single_process, fresh_prefect_home
):
    """Two replicas of one rank (`--no-prefect`) until replica 1's rank is SIGKILLed while it
    scores its first group's rewards, after replica 0 finished its first group's rollout;
    `--resume` on the Prefect flow finishes the run with the single process's checkpoint. The
    group that had finished is taken as recorded (its files untouched), the committed prompt
    states are read back, and the UI names and tags each group's tasks with its replica."""
    config, reference_checkpoint, reference = single_process["grpo"]
    root = tmp_path / "root"
    config = _with_replicas(_config(root, checkpoint_dir("qwen3_5"), "grpo", "killed"), 1)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    step = root / "runs" / "killed" / "steps" / "000000"
    finished = step / "finished" / "g0-rollout.json"
    # Every reward call takes 1 s (same values): replica 1 is inside or just past its first
    # group's rewards when replica 0's first rollout is recorded.
    slow = _env(tmp_path, LONGSTRAW_TEST_REWARD_DELAY_S="1.0")
    process = _train(path, tmp_path, slow, "--no-prefect")
    text, _ = _kill_spawned_ranks_when(
        process, finished.exists, "replica 0 never finished a rollout"
    )
    assert process.returncode != 0, text[-3000:]
    assert "rank 1" in text, text[-3000:]
    assert latest_checkpoint(config.storage, config.run_id) is None
    # What the killed run had finished (replica 0 may have gone on to its second group while
    # replica 1 died): kept as it is, and not run again.
    kept = {p: p.stat().st_mtime_ns for p in (step / "finished").glob("*.json")}
    done = {int(p.name.split("-")[0][1:]) for p in kept if p.name.endswith("-rollout.json")}
    assert 0 in done and 3 not in done, sorted(p.name for p in kept)

    fresh_prefect_home(tmp_path / "prefect")
    resumed = _train(path, tmp_path, _env(tmp_path), "--resume")
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out.decode()[-4000:]

    _assert_same_checkpoint(
        latest_checkpoint(config.storage, config.run_id),
        reference_checkpoint,
        checkpoint_dir("qwen3_5"),
    )
    (metrics,) = read_metrics(root / "runs" / "killed")
    _assert_same_metrics([metrics], reference)
    # The finished groups' records and files were taken as they were; the prompt states of
    # groups 0 and 1 (prefilled before their rewards) were read back from storage.
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert metrics.shards_reused >= 2 * 3, metrics
    assert metrics.shards_computed + metrics.shards_reused == GROUPS * 3 * 2  # two iterations
    with sqlite3.connect(tmp_path / "prefect" / "prefect.db") as db:
        runs = {
            name: json.loads(tags) for name, tags in db.execute("SELECT name, tags FROM task_run")
        }
    rollouts = sorted(n for n in runs if n.startswith("rollout group"))
    # Only the unfinished groups' rollouts ran again, each named with its replica and ranks.
    assert rollouts == [
        f"rollout group {g} on replica {g % 2} (rank {g % 2})"
        for g in range(GROUPS)
        if g not in done
    ], sorted(runs)
    backward = [n for n in runs if n.startswith("backward group 3")]
    assert backward and all("replica:1" in runs[n] and "group:3" in runs[n] for n in backward)
