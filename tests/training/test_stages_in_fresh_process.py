"""Every stage of a step, re-run in a fresh process from its refs alone, gives the same bits.

The step runs here stage by stage; then a subprocess (`longstraw.training.run_stage`) replays each
stage call with the same refs, forgetting everything it holds before each one, so every stage
must rebuild its policy, prompt state and inputs from storage. Results must be equal refs, and
the files the stage writes must be byte-identical to the ones this process wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from longstraw.schemas.refs import BackwardResult, GradRef, PolicyRef, RolloutRef, ScoresRef
from longstraw.schemas.results import AdvantagePlan
from longstraw.training import held, stages

from .helpers import run_config


def _dump(value):
    if isinstance(value, list):
        return [_dump(v) for v in value]
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


def _path(uri: str):
    from pathlib import Path

    return Path(uri.removeprefix("file://"))


@pytest.fixture(scope="module")
def step_calls(tmp_path_factory, checkpoint_dir):
    root = tmp_path_factory.mktemp("fresh")
    config = run_config(
        root,
        checkpoint_dir("qwen3_5"),
        run_id="fresh",
        num_steps=2,
        grpo={"beta": 0.04, "num_generations": 3},
        data={"rewards": ["tests.training.helpers:checksum_reward"]},
        train={"groups_per_step": 1},
        persist_mode="synchronous",
    )
    calls = []

    def call(name, *args, **kwargs):
        result = getattr(stages, name)(config, *args, **kwargs)
        calls.append((name, args, kwargs, result))
        return result

    policy = stages.open_run(config)
    (prompt,) = call("plan_step", policy)
    call("prefill_shard", policy, prompt, 1)
    call("prefill_prompt", policy, prompt)
    rollout = call("rollout_group", policy, prompt)
    ref_scores = call("score_group", policy, rollout, "reference")
    old_scores = call("score_group", policy, rollout, "old")
    plan = call("compute_advantages", [rollout])
    result = call("backward_group", policy, rollout, plan, 0, ref_scores, old_scores)
    total = call("reduce_gradients", policy, [result.grad])
    update = call("apply_update", policy, total)
    # The written files as this process left them (the subprocess rewrites the same paths; the
    # checkpoint then removes the gradient files it covers).
    kept = root / "kept"
    kept.mkdir()
    files = {}
    for _name, _, _, value in calls:
        for uri in _written(value):
            copy = kept / f"{len(files)}-{_path(uri).name}"
            shutil.copyfile(_path(uri), copy)
            files[uri] = copy
    after = update.policy.model_copy(update={"step": 1})
    checkpoint = call("write_checkpoint", after)
    checkpoint_dir = _path(checkpoint.checkpoint.uri)
    shutil.copytree(checkpoint_dir, kept / "checkpoint")
    shutil.rmtree(checkpoint_dir)
    held.forget_run(config.run_id)
    return config, calls, files, kept / "checkpoint", checkpoint_dir


def _written(value) -> list[str]:
    if isinstance(value, RolloutRef | ScoresRef | GradRef):
        return [value.uri]
    if isinstance(value, BackwardResult):
        return [value.grad.uri]
    return []


@pytest.mark.processes
def test_every_stage_rerun_in_a_fresh_process_gives_the_same_refs_and_bytes(step_calls, tmp_path):
    config, calls, files, kept_checkpoint, checkpoint_dir = step_calls
    payload = [
        {
            "stage": name,
            "config": config.model_dump(mode="json"),
            "args": [_dump(a) for a in args],
            "kwargs": {k: _dump(v) for k, v in kwargs.items()},
        }
        for name, args, kwargs, _ in calls
    ]
    # Two processes: the checkpoint (last) removes the gradient files compared after the first.
    lines = _run_fresh(payload[:-1], tmp_path / "calls.json")
    written = {uri: _path(uri).read_bytes() for uri in files}
    lines += _run_fresh(payload[-1:], tmp_path / "checkpoint.json")
    assert len(lines) == len(calls)
    for (name, _, _, expected), line in zip(calls, lines, strict=True):
        again = json.loads(line)
        if name == "backward_group":
            # Wall-clock seconds and peak memory differ between processes; the rest must not.
            for stats in (again["stats"], _dump(expected)["stats"]):
                stats.pop("seconds"), stats.pop("peak_rss_bytes")
            expected_dump = _dump(expected)
            expected_dump["stats"].pop("seconds"), expected_dump["stats"].pop("peak_rss_bytes")
            assert again == expected_dump, name
        elif name in ("prefill_prompt", "rollout_group", "score_group", "apply_update"):
            for value in (again, expected_dump := _dump(expected)):
                value.pop("seconds", None)
            if name == "prefill_prompt":
                # The fresh process read the committed state back instead of computing it.
                assert again["shards_computed"] == 0
                assert again["shards_reused"] == expected.shards_computed + expected.shards_reused
                assert again["state"] == expected_dump["state"]
            else:
                assert again == expected_dump, name
        elif name == "prefill_shard":
            assert again == _dump(expected) | {"computed": False}, name
        else:
            assert again == _dump(expected), name
    for uri, copy in files.items():
        assert written[uri] == copy.read_bytes(), f"{uri} differs"
    # apply_update's weights: the fresh process rebuilt the policy (checkpoint + update) and
    # wrote the checkpoint again: byte-identical weights and optimizer state.
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert (checkpoint_dir / name).read_bytes() == (kept_checkpoint / name).read_bytes(), name


def _run_fresh(payload: list, path) -> list[str]:
    path.write_text(json.dumps(payload))
    # The fresh process computes with this one's thread count: fp32 reductions split over
    # another number of threads round differently, and the files are compared byte for byte.
    env = os.environ | {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    done = subprocess.run(
        [sys.executable, "-m", "longstraw.training.run_stage", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()


def test_refs_between_stages_are_plain_json(step_calls):
    _, calls, _, _, _ = step_calls
    kinds = {type(result) for _, _, _, result in calls if not isinstance(result, list)}
    assert {PolicyRef, RolloutRef, ScoresRef, BackwardResult, GradRef, AdvantagePlan} <= kinds
    for _, args, _, result in calls:
        for value in [*args, result]:
            json.dumps(_dump(value))
