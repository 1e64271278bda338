"""The Prefect task that runs a group's gradient over local ranks matches the single process."""

from __future__ import annotations

import pytest
import torch
from longstraw.tasks.distributed import (
    ShardedGroupJob,
    load_grad_file,
    retry_on_rank_death,
    sharded_backward_group,
)

from longstraw.distributed.launch import RankFailedError
from longstraw.engine.group import GradBuffer, accumulate_group_gradients
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.storage import StateKey, StorageConfig
from longstraw.storage import read_manifest
from longstraw.storage.paths import state_dir_uri

SEED = 42


@pytest.mark.parametrize("schedule", ["sequential", "wavefront"])
def test_sharded_backward_task_matches_single_process(
    checkpoint_dir, load_tiny, tmp_path, schedule
):
    path = checkpoint_dir("qwen3_5")
    gen = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(0, 500, (75,), generator=gen)
    responses = [torch.randint(0, 500, (n,), generator=gen) for n in (5, 9)]
    grpo = GRPOConfig(loss_type="grpo", num_generations=2)
    storage = StorageConfig(root_uri=str(tmp_path / "states"), persist_mode="synchronous")
    key = StateKey.policy("task", 0, "weights", "prompt")
    job = ShardedGroupJob(
        checkpoint=str(path),
        policy_version=0,
        prompt_ids=prompt.tolist(),
        responses=[r.tolist() for r in responses],
        advantages=[0.8, -0.8],
        grpo=grpo,
        shard_tokens=16,
        world_size=2,
        output_dir=str(tmp_path),
        storage=storage,
        state_key=key,
        schedule=schedule,
    )
    ref = sharded_backward_group.fn(job)
    # The ranks recorded the prompt state and committed it.
    manifest, _ = read_manifest(state_dir_uri(storage, key), storage)
    assert len(manifest.shards) == 5 and manifest.num_tokens == 74
    sharded = load_grad_file(ref)

    model = load_tiny("qwen3_5")
    single = GradBuffer(model)
    accumulate_group_gradients(
        model, prompt, responses, [0.8, -0.8], grpo, shard_tokens=16, grad_buffer=single
    )
    assert set(sharded) == set(single.grads)
    for name, want in single.grads.items():
        # The cross-rank log-sum-exp merge reorders fp32 sums: measured max diff ~3e-6 of the
        # tensor's largest entry (tests/distributed/test_sharded_engine.py).
        scale = want.abs().max().clamp(min=1e-30)
        diff = (sharded[name] - want).abs().max() / scale
        assert diff < 2e-5, f"{name}: max_diff/max|ref| {diff:.2e}"


class _Finished:
    def __init__(self, error: BaseException):
        self.error = error

    def result(self):
        raise self.error


@pytest.mark.parametrize(
    ("error", "retried"),
    [
        (RankFailedError(1, "process exited with code -9 without a result", -9), True),
        (RankFailedError(1, "ValueError: bad input"), False),
        (TimeoutError("collective timed out"), True),
        (ValueError("bad input"), False),
    ],
)
def test_task_retries_a_dead_rank_but_not_a_raising_one(error, retried):
    assert retry_on_rank_death(None, None, _Finished(error)) is retried
