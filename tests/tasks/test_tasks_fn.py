"""LongStraw's Prefect tasks called as plain functions (`.fn()`): refs in, refs out.

No Prefect API is involved: `.fn()` runs the stage in this process, against what this process
holds behind the refs (`longstraw.training.held`, `longstraw.storage.artifacts`) and the run's
storage under tmp.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from longstraw.grpo.advantages import group_advantages
from longstraw.grpo.rewards import register_reward
from longstraw.models.checkpoint import read_checkpoint_metadata
from longstraw.schemas.data import HaystackTaskConfig
from longstraw.schemas.refs import GradRef, PromptRef, RolloutRecord
from longstraw.schemas.run import RunConfig
from longstraw.storage import artifacts
from longstraw.tasks.policies import retry_on_transient
from longstraw.tasks.stages import (
    apply_update,
    backward_group,
    compute_advantages,
    open_run,
    plan_step,
    prefill_prompt,
    prefill_shard,
    reduce_gradients,
    rollout_group,
    score_group,
)
from longstraw.training import held
from longstraw.training.context import initial_checkpoint

PROMPT_TOKENS = 63
SHARD_TOKENS = 24
NUM_SHARDS = 3  # ceil((63 - 1) / 24)


@register_reward("tasks_test_checksum")
def _checksum_reward(prompt: str, response: str, metadata: dict) -> float:
    """Differs between responses, so advantages and gradients are non-zero."""
    return (sum(response.encode()) % 11) / 10.0


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("task-runs")


def tiny_config(root, run_id: str, **grpo) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run_id": run_id,
            "engine": {"shard_tokens": SHARD_TOKENS, "prompt_grad": "exact"},
            "grpo": {
                "num_generations": 3,
                "max_completion_length": 2,
                "learning_rate": 1e-2,
                "loss_type": "grpo",
                **grpo,
            },
            "data": {
                "type": "haystack",
                "num_prompts": 4,
                "rewards": ["tasks_test_checksum"],
                "task": HaystackTaskConfig.tiny(num_prompt_tokens=PROMPT_TOKENS).model_dump(),
            },
            "train": {"num_steps": 2, "groups_per_step": 1},
            "storage": {"root_uri": str(root), "persist_mode": "synchronous"},
        }
    )


def _start(config):
    held.forget_run(config.run_id)
    policy = open_run.fn(config)
    (prompt,) = plan_step.fn(config, policy)
    return policy, prompt


def test_plan_step_returns_the_steps_prompt_refs_at_the_current_version(root):
    config = tiny_config(root, "plan")
    policy, prompt = _start(config)

    assert config.train.groups_per_step == 1
    example = held.policy(config, policy).source(0)
    assert prompt.index == 0
    assert prompt.prompt_id == example.prompt_id
    assert prompt.prompt_digest == example.digest
    assert prompt.num_tokens == PROMPT_TOKENS
    assert prompt.num_shards == NUM_SHARDS
    assert prompt.policy_version == 0
    initial = read_checkpoint_metadata(initial_checkpoint(config)).weights_digest
    assert prompt.weights_digest == initial == policy.weights_digest


def test_prefill_shard_tasks_compute_each_shard_once_and_the_commit_counts_them(root):
    config = tiny_config(root, "prefill")
    policy, prompt = _start(config)

    first = prefill_shard.fn(config, policy, prompt, 0)
    assert (first.shard, first.computed, first.policy_version) == (0, True, 0)
    assert first.prompt_digest == prompt.prompt_digest
    assert first.weights_digest == prompt.weights_digest
    # The same shard again is already held: nothing computed.
    assert prefill_shard.fn(config, policy, prompt, 0).computed is False
    assert prefill_shard.fn(config, policy, prompt, NUM_SHARDS - 1).computed is True

    report = prefill_prompt.fn(config, policy, prompt)
    assert (report.shards_computed, report.shards_reused) == (NUM_SHARDS, 0)
    assert report.state is not None and report.state.num_tokens == PROMPT_TOKENS - 1

    # A fresh process (nothing held) reads the committed state back: nothing recomputed.
    held.forget_run(config.run_id)
    again = prefill_prompt.fn(config, policy, prompt)
    assert (again.shards_computed, again.shards_reused) == (0, NUM_SHARDS)
    assert again.state == report.state


def _rollout(root, config, rewards, lengths, truncated, g):
    prompt = PromptRef(
        index=g,
        prompt_id="p",
        prompt_digest="d",
        num_tokens=PROMPT_TOKENS,
        num_shards=NUM_SHARDS,
        policy_version=0,
        weights_digest="w",
    )
    record = RolloutRecord(
        prompt=prompt,
        response_ids=[[7] * n for n in lengths],
        sampler_logprobs=[[-1.0] * n for n in lengths],
        texts=["x"] * len(lengths),
        truncated=truncated,
        rewards=rewards,
    )
    uri, digest = artifacts.write_json(root / f"record-{g}.json", record)
    from longstraw.schemas.refs import RolloutRef

    return RolloutRef(uri=uri, digest=digest, prompt=prompt, step=0, rewards=rewards)


def test_compute_advantages_matches_group_advantages_and_fixes_the_normalisers(root):
    config = tiny_config(root, "advantages", mask_truncated_completions=True)
    rewards = [[0.0, 1.0, 0.5], [0.25, 0.25, 1.0]]
    lengths = [[2, 1, 2], [1, 2, 2]]
    truncated = [[True, False, False], [False, False, True]]
    rollouts = [_rollout(root, config, rewards[g], lengths[g], truncated[g], g) for g in range(2)]
    plan = compute_advantages.fn(config, rollouts)

    expected = group_advantages(torch.tensor(rewards, dtype=torch.float64), "group").float()
    assert torch.equal(torch.tensor(plan.advantages), expected)
    # Truncated completions are masked out of the loss (mask_truncated_completions).
    assert plan.loss_masks == [[[0.0, 0.0], [1.0], [1.0, 1.0]], [[1.0], [1.0, 1.0], [0.0, 0.0]]]
    assert plan.num_items_in_batch == 6.0
    assert plan.num_sequences_in_batch == 6


def test_invalid_run_configs_are_refused_when_built():
    for bad in (
        {"run_id": "runs/a"},
        {"engine": {"shard_tokens": 0}},
        {"grpo": {"num_generations": 1}},
        {"train": {"num_steps": 0}},
        {"storage": {"root_uri": "gs://bucket"}},
        {"model": {"dtype": "float16"}},
        {"trian": {}},
    ):
        with pytest.raises(ValidationError):
            RunConfig.model_validate(bad)


def test_tasks_refuse_bad_parameters_before_any_compute(root):
    config = tiny_config(root, "refuse")
    policy, prompt = _start(config)

    with pytest.raises(ValueError, match="out of range"):
        prefill_shard.fn(config, policy, prompt, NUM_SHARDS)
    stale = prompt.model_copy(update={"policy_version": 1})
    with pytest.raises(ValueError, match="plan the step again"):
        prefill_shard.fn(config, policy, stale, 0)
    session = held.prefill_session(
        held.policy(config, policy), held.policy(config, policy).source(0)
    )
    assert session.shards_computed == 0

    with pytest.raises(ValueError, match="'reference' or 'old'"):
        score_group.fn(config, policy, None, "new")

    def grad_ref(version: int) -> GradRef:
        return GradRef(uri=f"file://{root}/none-{version}", digest="x", policy_version=version)

    with pytest.raises(ValueError, match="cannot update version 0"):
        reduce_gradients.fn(config, policy, [grad_ref(0), grad_ref(1)])

    ctx = held.policy(config, policy)
    before = {n: p.detach().clone() for n, p in ctx.model.named_parameters()}
    with pytest.raises(ValueError, match="recompute the step's backward"):
        apply_update.fn(config, policy, grad_ref(5))
    assert ctx.policy_version == 0 and ctx.optimizer.step_count == 0
    for name, p in ctx.model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_backward_group_retried_after_a_failure_mid_sweep_gives_the_same_gradient(
    root, monkeypatch
):
    import longstraw.engine.group as group_module

    config = tiny_config(root, "retry")
    policy, prompt = _start(config)
    prefill_prompt.fn(config, policy, prompt)
    rollout = rollout_group.fn(config, policy, prompt)
    plan = compute_advantages.fn(config, [rollout])

    clean = backward_group.fn(config, policy, rollout, plan, 0).grad

    # Fail after every branch and the first swept shard were added into the task's buffers.
    real_sweep = group_module.sweep_prompt_shards

    def failing_sweep(model, state, cotangent, **options):
        def after(shard):
            raise OSError("injected: storage went away mid-sweep")

        return real_sweep(model, state, cotangent, **{**options, "after_shard": after})

    monkeypatch.setattr(group_module, "sweep_prompt_shards", failing_sweep)
    with pytest.raises(OSError, match="injected"):
        backward_group.fn(config, policy, rollout, plan, 0)
    monkeypatch.setattr(group_module, "sweep_prompt_shards", real_sweep)
    retried = backward_group.fn(config, policy, rollout, plan, 0).grad

    assert retried.digest == clean.digest, "a retry must start from zeroed buffers"
    assert retried.policy_version == clean.policy_version == 0
    grads = artifacts.read_grads(retried)
    assert any(float(g.abs().max()) > 0 for g in grads.values())


class _State:
    def __init__(self, error: BaseException | None):
        self.error = error

    def result(self):
        if self.error is not None:
            raise self.error


def test_retry_condition_retries_transient_faults_only():
    assert retry_on_transient(None, None, _State(OSError("disk"))) is True
    assert retry_on_transient(None, None, _State(TimeoutError())) is True
    assert retry_on_transient(None, None, _State(ValueError("bad input"))) is False
    assert retry_on_transient(None, None, _State(None)) is False


def test_no_task_retries_a_storage_fault():
    """A storage fault (a full or read-only volume, an S3 endpoint still down or frozen after
    its own `storage.s3_max_attempts`, a damaged state) is not retried by Prefect: the S3
    client's attempts are the one bound on a stall, with or without Prefect, and a task retry
    would redo the stage's compute only to wait as long again (docs/operations.md)."""
    from prefect import Task

    from longstraw.tasks import stages as tasks
    from longstraw.training.storage_faults import StorageFault

    retried = [t for t in vars(tasks).values() if isinstance(t, Task) and t.retries]
    assert len(retried) >= 8, [t.name for t in retried]
    for task in retried:
        assert task.retry_condition_fn is retry_on_transient, task.name
    for kind in ("s3", "full", "read-only", "damaged-state"):
        fault = StorageFault("what", "fix", path="s3://bucket/key", kind=kind)
        assert retry_on_transient(None, None, _State(fault)) is False, kind


def test_grad_ref_digest_tells_equal_doubled_and_partial_contributions_apart():
    from longstraw.engine.group import GradBuffer

    model = torch.nn.Linear(4, 3)
    grads = GradBuffer(model)
    for g in grads.grads.values():
        g.normal_()
    same = GradBuffer(model)
    for name, g in same.grads.items():
        g.copy_(grads.grads[name])
    doubled = GradBuffer(model).add_(grads).add_(grads)
    partial = GradBuffer(model)
    partial.grads["weight"].copy_(grads.grads["weight"])

    def digest(buffer):
        return artifacts.grads_digest(buffer.grads)

    assert digest(grads) == digest(same)
    assert len({digest(grads), digest(doubled), digest(partial)}) == 3
