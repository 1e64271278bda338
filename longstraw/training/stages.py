"""The stages of one GRPO step: typed refs in, typed refs out, the same in any process.

    plan_step ─► prefill_shard × N ─► prefill_prompt ─► rollout_group ─► score_group (ref / old)
      ─► compute_advantages ─► backward_group × groups ─► reduce_gradients ─► apply_update
      ─► write_checkpoint ─► record_step

`longstraw.training.step.run_step` composes them; the in-process loop calls them as they are and
the Prefect flow through one thin task each. What passes between stages is refs — a policy
(checkpoint + updates since), prompt-state URIs, rollout and score records, gradient files —
never a process's objects: a cache of this process sits behind each ref (`training.held`,
`storage.artifacts`), and a stage run in a fresh process rebuilds what it needs from storage.

Stages that compute on the model are `on_all_ranks`: with `parallel.world_size > 1` every rank
runs them together on its slice of the prompt state (`longstraw.distributed`), and rank 0 writes
the files. Every stage raises a storage fault (full or read-only volume, unreachable S3, damaged
state) as a one-line StorageFault (`training.storage_faults`).
"""

from __future__ import annotations

import contextlib
import json
import time

import torch

from longstraw.data.rewards import register_haystack_rewards
from longstraw.distributed.stage_group import from_writer, is_writer, on_all_ranks
from longstraw.engine.group import group_gradient, group_inputs
from longstraw.engine.replay import replay_branch
from longstraw.engine.rollout import SamplingParams, sample_responses
from longstraw.engine.state import shard_bounds
from longstraw.engine.state_tiers import state_traffic
from longstraw.grpo.advantages import group_advantages
from longstraw.grpo.losses import loss_mask
from longstraw.grpo.rewards import score_group as score_rewards
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.refs import (
    BackwardResult,
    GradRef,
    PolicyRef,
    PrefillReport,
    PromptRef,
    RolloutRecord,
    RolloutRef,
    ScoresRef,
    ShardRef,
    UpdateResult,
)
from longstraw.schemas.results import AdvantagePlan, StepMetrics
from longstraw.schemas.run import RunConfig
from longstraw.storage import artifacts
from longstraw.storage.checkpoints import retain_checkpoints, run_dir
from longstraw.training import held
from longstraw.training.agent import sample_trajectories, trajectory_rewards
from longstraw.training.context import start_policy
from longstraw.training.imported import imported_importance_weights
from longstraw.training.metrics import STEP_RECORD_KEY, read_metrics, write_step_metrics
from longstraw.training.policy_storage import CheckpointContents
from longstraw.training.storage_faults import storage_faults
from longstraw.training.streamed_state import budgeted_state
from longstraw.training.sweep_checkpoints import sweep_checkpoints, sweep_key, sweep_progress


@storage_faults
def open_run(config: RunConfig, resume: bool = False) -> PolicyRef:
    """Where the run starts: its latest checkpoint (`resume`) or the configured model."""
    return start_policy(config, resume=resume)


@on_all_ranks
@storage_faults
def plan_step(config: RunConfig, policy: PolicyRef) -> list[PromptRef]:
    """The prompts of step `policy.step`, at the policy's version (on every rank: the first
    stage of a step, where a rank that holds no policy yet rebuilds and shards it)."""
    ctx = held.policy(config, policy)
    first = policy.step * config.train.groups_per_step
    prompts = []
    for index in range(first, first + config.train.groups_per_step):
        example = ctx.source(index)
        num_tokens = example.prompt_ids.numel()
        prompts.append(
            PromptRef(
                index=index,
                prompt_id=example.prompt_id,
                prompt_digest=example.digest,
                num_tokens=num_tokens,
                num_shards=len(shard_bounds(num_tokens - 1, config.engine.shard_tokens)),
                policy_version=policy.policy_version,
                weights_digest=policy.weights_digest,
            )
        )
    return prompts


@on_all_ranks
@storage_faults
def ready_to_compute(config: RunConfig, policy: PolicyRef) -> None:
    """Every rank holds the policy at `policy`'s version with its weights gathered: what the
    stages a data-parallel replica runs on its own ranks need first (loading and gathering the
    sharded policy are collectives of every rank)."""
    held.policy(config, policy).gather_weights()


@on_all_ranks
@storage_faults
def prefill_shard(config: RunConfig, policy: PolicyRef, prompt: PromptRef, shard: int) -> ShardRef:
    """Make shards 0..`shard` of the prompt's state present (computed, or read back from the
    shard manifests an earlier attempt recorded) and persisted: on one process, or by the ranks
    together (each computes and records the shards it owns)."""
    if not 0 <= shard < prompt.num_shards:
        raise ValueError(
            f"shard {shard} is out of range: prompt {prompt.prompt_id} has {prompt.num_shards} "
            "shards (plan_step gives the count)"
        )
    ctx = held.policy(config, policy)
    example = held.check_prompt(ctx, prompt)
    ctx.gather_weights()
    computed = held.prefill_session(ctx, example).computed_through(shard)
    return ShardRef(
        prompt_digest=prompt.prompt_digest,
        shard=shard,
        policy_version=prompt.policy_version,
        weights_digest=prompt.weights_digest,
        computed=computed,
    )


@on_all_ranks
@storage_faults
def prefill_prompt(config: RunConfig, policy: PolicyRef, prompt: PromptRef) -> PrefillReport:
    """The prompt's whole state at the policy's version: any shard still missing is computed,
    then the state is verified and committed."""
    started = time.perf_counter()
    ctx = held.policy(config, policy)
    example = held.check_prompt(ctx, prompt)
    ctx.gather_weights()
    session = held.prefill_session(ctx, example)
    session.finish()
    ref, computed, reused = session.totals()
    return PrefillReport(
        state=ref,
        shards_computed=computed,
        shards_reused=reused,
        seconds=time.perf_counter() - started,
    )


def sampling_params(ctx) -> SamplingParams:
    """How a group's responses are sampled: `grpo`'s count, temperature and filters."""
    cfg = ctx.config.grpo
    return grpo_sampling(cfg, ctx.tokenizer.eos_token_id, cfg.num_generations, cfg.temperature)


def grpo_sampling(
    grpo: GRPOConfig, eos_token_id: int | None, num_samples: int, temperature: float
) -> SamplingParams:
    """`num_samples` responses at `temperature` with `grpo`'s length and top-p / top-k / min-p
    filters, stopping at `eos_token_id` (None: at the length only)."""
    return SamplingParams(
        num_samples=num_samples,
        max_new_tokens=grpo.max_completion_length,
        temperature=temperature,
        top_p=grpo.top_p,
        top_k=grpo.top_k,
        min_p=grpo.min_p,
        stop_token_ids=() if eos_token_id is None else (int(eos_token_id),),
    )


def _sample(ctx, state, generator):
    return sample_responses(
        ctx.model,
        state,
        sampling_params(ctx),
        generator=generator,
        tokenizer=ctx.tokenizer,
        exchange=held.prefix_exchange(),
    )


@torch.no_grad()
def score_logprobs(model, state, responses, *, temperature: float) -> list[torch.Tensor]:
    """[G][R_i] no-grad log-probs of `responses` on this process's state (or rank's slice)."""
    exchange = held.prefix_exchange()
    return [
        replay_branch(
            model, state, torch.as_tensor(r, dtype=torch.long), temperature=temperature,
            exchange=exchange,
        )[0]
        for r in responses
    ]  # fmt: skip


@on_all_ranks
@storage_faults
def rollout_group(config: RunConfig, policy: PolicyRef, prompt: PromptRef) -> RolloutRef:
    """Sample G responses in one batch from the prompt's state (or take the run's imported
    responses) and score their rewards."""
    ctx = held.policy(config, policy)
    example = held.check_prompt(ctx, prompt)
    ctx.gather_weights()
    state = held.prompt_state(ctx, example)
    started = time.perf_counter()
    imported = getattr(ctx.source, "imported", None)
    weights = None
    with budgeted_state(config.engine, ctx.model, state) as state:
        if config.agent is not None:
            generator = held.sampling_generator(config, policy.step, prompt.index)
            trajectories = sample_trajectories(ctx, state, example, sampling_params(ctx), generator)
            return _agent_rollout_ref(
                ctx, policy, prompt, example, trajectories, started, state_traffic(state)
            )
        if imported is None:
            generator = held.sampling_generator(config, policy.step, prompt.index)
            responses = _sample(ctx, state, generator)
        else:
            responses = imported.group(example.prompt_id, policy.policy_version)
            cfg = config.grpo
            if cfg.vllm_importance_sampling_correction:
                weights = imported_importance_weights(
                    ctx.model,
                    state,
                    responses,
                    temperature=cfg.temperature,
                    cap=cfg.vllm_importance_sampling_cap,
                    score=score_logprobs,
                )
        traffic = state_traffic(state)
    rollout_seconds = time.perf_counter() - started
    started = time.perf_counter()
    register_haystack_rewards()  # the built-in names a config may list in data.rewards
    rewards = (
        score_rewards(
            example.rewards,
            config.grpo.reward_weights,
            example.text or "",
            [r.text or "" for r in responses],
            example.metadata,
            where=prompt_in_step(example.prompt_id, prompt.index, policy.step),
        )
        if is_writer()
        else []
    )
    # Rewards run once (on rank 0: a user's reward may be costly or call out); every rank
    # needs them in its record.
    rewards = from_writer(rewards)
    record = RolloutRecord(
        prompt=prompt,
        response_ids=[list(r.token_ids) for r in responses],
        sampler_logprobs=[list(r.logprobs) for r in responses],
        texts=[r.text or "" for r in responses],
        truncated=[r.truncated for r in responses],
        rewards=[float(x) for x in rewards],
        importance_weights=None if weights is None else [w.tolist() for w in weights],
    )
    seconds = {"rollout": rollout_seconds, "reward": time.perf_counter() - started}
    return _stored_rollout(config, policy, record, seconds, traffic)


def prompt_in_step(prompt_id: str, index: int, step: int) -> str:
    """How errors name a group's prompt: its id, its group and the step."""
    return f"prompt {prompt_id!r} (group {index} of step {step})"


def _stored_rollout(config, policy, record: RolloutRecord, seconds, traffic) -> RolloutRef:
    """Write a group's rollout record (rank 0 writes; every rank gets the ref)."""
    path = artifacts.step_dir(config.storage, config.run_id, policy.step) / (
        f"rollout-g{record.prompt.index}.json"
    )
    uri, digest = artifacts.write_json(path, record, write=is_writer())
    return RolloutRef(
        uri=uri,
        digest=digest,
        prompt=record.prompt,
        step=policy.step,
        rewards=record.rewards,
        seconds=seconds,
        state_traffic=traffic,
    )


def _agent_rollout_ref(ctx, policy, prompt, example, trajectories, started, traffic) -> RolloutRef:
    """The agent run's rollout record: trajectories with the environment and their rewards."""
    config = ctx.config
    rollout_seconds = time.perf_counter() - started
    started = time.perf_counter()
    register_haystack_rewards()
    rewards = trajectory_rewards(
        config,
        example,
        trajectories,
        where=prompt_in_step(example.prompt_id, prompt.index, policy.step),
    )
    record = RolloutRecord(
        prompt=prompt,
        response_ids=[t.token_ids for t in trajectories],
        sampler_logprobs=[t.logprobs for t in trajectories],
        texts=[t.text for t in trajectories],
        truncated=[t.truncated for t in trajectories],
        rewards=rewards,
        loss_masks=[t.loss_mask for t in trajectories],
        finish_reasons=[t.finish_reason for t in trajectories],
        num_turns=[len(t.turns) for t in trajectories],
        errors=[t.error for t in trajectories],
    )
    seconds = {"rollout": rollout_seconds, "reward": time.perf_counter() - started}
    return _stored_rollout(config, policy, record, seconds, traffic)


def rollout_record(rollout: RolloutRef) -> RolloutRecord:
    return artifacts.read_json(rollout.uri, rollout.digest, RolloutRecord)


@on_all_ranks
@storage_faults
def score_group(
    config: RunConfig, policy: PolicyRef, rollout: RolloutRef, which: str
) -> ScoresRef | None:
    """No-grad log-probs of the group's responses: `which` is "reference" (the KL term, beta >
    0; None without a reference model) or "old" (the rollout policy, num_iterations > 1)."""
    if which not in ("reference", "old"):
        raise ValueError(f"which must be 'reference' or 'old', got {which!r}")
    started = time.perf_counter()
    ctx = held.policy(config, policy)
    example = held.check_prompt(ctx, rollout.prompt)
    ctx.gather_weights()
    responses = rollout_record(rollout).response_ids
    with contextlib.ExitStack() as stack:
        if which == "reference":
            if not ctx.has_reference:
                return None
            model = stack.enter_context(ctx.reference_policy())
            state = stack.enter_context(held.reference_state(ctx, example, model))
        else:
            model, state = ctx.model, held.prompt_state(ctx, example)
        state = stack.enter_context(budgeted_state(config.engine, model, state))
        scored = score_logprobs(model, state, responses, temperature=config.grpo.temperature)
        traffic = state_traffic(state)
    path = artifacts.step_dir(config.storage, config.run_id, policy.step) / (
        f"scores-g{rollout.prompt.index}-{which}.json"
    )
    uri, digest = artifacts.write_json(path, [s.tolist() for s in scored], write=is_writer())
    return ScoresRef(
        uri=uri,
        digest=digest,
        which=which,
        seconds=time.perf_counter() - started,
        state_traffic=traffic,
    )


@storage_faults
def compute_advantages(config: RunConfig, rollouts: list[RolloutRef]) -> AdvantagePlan:
    """Group-relative advantages (TRL's scale_rewards), loss masks and the step's normalisers,
    fixed before any replay."""
    rewards = torch.tensor([r.rewards for r in rollouts], dtype=torch.float64)
    advantages = group_advantages(rewards, config.grpo.scale_rewards).to(torch.float32)
    masks = []
    for rollout in rollouts:
        record = rollout_record(rollout)
        given = record.loss_masks or [[1] * len(ids) for ids in record.response_ids]
        masks.append(
            [
                loss_mask(torch.tensor(mask, dtype=torch.float32), truncated, config.grpo).tolist()
                for mask, truncated in zip(given, record.truncated, strict=True)
            ]
        )
    return AdvantagePlan(
        advantages=advantages.tolist(),
        loss_masks=masks,
        num_items_in_batch=float(sum(sum(m) for group in masks for m in group)),
        num_sequences_in_batch=sum(len(group) for group in masks),
    )


def _scores(ref: ScoresRef | None) -> list[torch.Tensor] | None:
    if ref is None:
        return None
    return [torch.tensor(s) for s in artifacts.read_json(ref.uri, ref.digest)]


@on_all_ranks
@storage_faults
def backward_group(
    config: RunConfig,
    policy: PolicyRef,
    rollout: RolloutRef,
    plan: AdvantagePlan,
    group: int,
    ref_scores: ScoresRef | None = None,
    old_scores: ScoresRef | None = None,
    iteration: int = 0,
) -> BackwardResult:
    """Replay group `group`'s branches one at a time (and, in exact mode, sweep the prefill
    shards in reverse) into zeroed fp32 buffers; its contribution, stored.

    Replay and the reverse sweep are one stage, not two: the prompt cotangent dS lives only
    between them, so one idempotent unit is what makes a retry safe (it cannot double-count).
    In exact mode the sweep commits checkpoints of its progress (`training.sweep_checkpoints`):
    run again with the same inputs (`--resume`, a retry), the stage continues after the latest,
    bitwise what one uninterrupted run gives.
    """
    ctx = held.policy(config, policy)
    prompt = rollout.prompt.model_copy(
        update={"policy_version": policy.policy_version, "weights_digest": policy.weights_digest}
    )
    example = held.check_prompt(ctx, prompt)
    record = rollout_record(rollout)
    started = time.perf_counter()
    ctx.gather_weights()
    state = held.prompt_state(ctx, example)
    prefill_seconds = time.perf_counter() - started
    inputs = group_inputs(
        ctx.model,
        record.response_ids,
        torch.tensor(plan.advantages[group], dtype=torch.float32),
        config.grpo,
        prompt_grad=config.engine.prompt_grad,
        old_logprobs=_scores(old_scores),
        ref_logprobs=_scores(ref_scores),
        loss_masks=[torch.tensor(m) for m in plan.loss_masks[group]],
        num_items_in_batch=plan.num_items_in_batch,
        num_sequences_in_batch=plan.num_sequences_in_batch,
        importance_weights=None
        if record.importance_weights is None
        else [torch.tensor(w) for w in record.importance_weights],
    )
    # Each rank (one process: the only one) holds its part of the state and of the gradient:
    # with data-parallel replicas, the rows the replicas' sum leaves on its FSDP shards
    # (`distributed.gradient_slices`; a replica of one rank holds them all).
    # A kill mid-sweep costs the shards since the last sweep checkpoint, not the sweep.
    key = sweep_key(config, policy, rollout, plan, group, ref_scores, old_scores, iteration)
    grads, stats = group_gradient(
        ctx.model, state, inputs, config.grpo, config.engine, exchange=held.prefix_exchange(),
        checkpoints=sweep_checkpoints(config, key),
        on_sweep_shard=sweep_progress(rollout.prompt.index),
    )  # fmt: skip
    stats = stats.model_copy(
        update={"seconds": stats.seconds.model_copy(update={"prefill": prefill_seconds})}
    )
    path = (
        artifacts.step_dir(config.storage, config.run_id, policy.step)
        / "grads"
        / f"g{rollout.prompt.index}-i{iteration}.safetensors"
    )
    grad = ctx.policy_storage.store_gradient(
        path, grads.grads, policy_version=policy.policy_version, num_tokens=sum(stats.num_tokens)
    )
    return BackwardResult(grad=grad, stats=stats)


@on_all_ranks
@storage_faults
def reduce_gradients(
    config: RunConfig, policy: PolicyRef, grads: list[GradRef], iteration: int = 0
) -> GradRef:
    """Sum the groups' contributions (the normaliser was applied once, before replay)."""
    versions = {g.policy_version for g in grads}
    if versions != {policy.policy_version}:
        raise ValueError(
            f"gradients of policy versions {sorted(versions)} cannot update version "
            f"{policy.policy_version}: recompute the step's backward"
        )
    ctx = held.policy(config, policy)
    # This process's rows of the step's gradient (summed across the replicas, if any).
    total = ctx.policy_storage.step_gradient(grads)
    for g in grads:
        artifacts.forget_grads(g)
    path = (
        artifacts.step_dir(config.storage, config.run_id, policy.step)
        / "grads"
        / f"reduced-i{iteration}.safetensors"
    )
    return ctx.policy_storage.store_gradient(
        path,
        total.grads,
        policy_version=policy.policy_version,
        num_tokens=sum(g.num_tokens for g in grads),
    )


@on_all_ranks
@storage_faults
def apply_update(config: RunConfig, policy: PolicyRef, grads: GradRef) -> UpdateResult:
    """One optimizer step: the policy's next version."""
    if grads.policy_version != policy.policy_version:
        raise ValueError(
            f"gradient was taken at policy version {grads.policy_version}, the policy is at "
            f"{policy.policy_version}: recompute the step's backward"
        )
    started = time.perf_counter()
    ctx = held.policy(config, policy)
    update = ctx.policy_storage.apply(grads)
    ctx.policy_version += 1
    ctx.updates.append(grads)
    held.drop_states_before(config.run_id, ctx.policy_version)
    return UpdateResult(
        policy=ctx.policy_ref(),
        policy_version=ctx.policy_version,
        grad_norm=update.grad_norm,
        learning_rate=update.learning_rate,
        clipped=update.clipped,
        seconds=time.perf_counter() - started,
        # Global counts (a sharded parameter's numel is the whole tensor's).
        trainable_parameters=sum(p.numel() for p in ctx.model.parameters() if p.requires_grad),
    )


def best_rewarded_versions(config: RunConfig) -> frozenset[int]:
    """{the policy version with the highest recorded mean reward} under
    `train.keep_best_checkpoint` (a step's rollouts measure the version it started from)."""
    if not config.train.keep_best_checkpoint:
        return frozenset()
    rows = read_metrics(run_dir(config.storage, config.run_id))
    return frozenset({max(rows, key=lambda m: m.reward_mean).policy_version} if rows else ())


@on_all_ranks
@storage_faults
def write_checkpoint(
    config: RunConfig, policy: PolicyRef, record: StepMetrics | None = None
) -> PolicyRef:
    """Commit a Hugging Face checkpoint of the policy with its optimizer state and `record`, the
    metrics row of the step that made it (`trainer_state.json`); the returned ref starts from it
    (and the gradient files it covers are removed)."""
    ctx = held.policy(config, policy)
    trainer_state = {
        "step": policy.step,
        "policy_version": ctx.policy_version,
        "run_id": config.run_id,
        "config": config.model_dump(mode="json"),
    }
    if record is not None:
        trainer_state[STEP_RECORD_KEY] = record.model_dump(mode="json")
    ref = ctx.policy_storage.write_checkpoint(
        CheckpointContents(
            config=config,
            policy_version=ctx.policy_version,
            tokenizer=ctx.tokenizer,
            trainer_state=trainer_state,
            base_weights_digest=ctx.base_weights_digest,
        )
    )
    if is_writer():
        artifacts.remove_step_gradients(config.storage, config.run_id, before_step=policy.step)
        if config.train.save_total_limit is not None:
            retain_checkpoints(
                config.storage,
                config.run_id,
                keep_latest=config.train.save_total_limit,
                also_keep=best_rewarded_versions(config),
            )
    ref = from_writer(ref)
    ctx.checkpoint, ctx.checkpoint_is_run_start, ctx.updates = ref, False, []
    return ctx.policy_ref()


def is_checkpoint_step(config: RunConfig, steps_done: int) -> bool:
    return steps_done % config.train.checkpoint_every == 0 or steps_done >= config.train.num_steps


@storage_faults
def record_step(config: RunConfig, metrics: StepMetrics) -> StepMetrics:
    """Write the step's row of the run's metrics (keyed by step: a re-run step replaces its row)."""
    write_step_metrics(config.storage, config.run_id, metrics)
    return metrics


def dump_result(value) -> str:
    """JSON of a stage's result (what `python -m longstraw.training.run_stage` prints)."""
    if isinstance(value, list):
        return json.dumps([v.model_dump(mode="json") for v in value])
    return "null" if value is None else value.model_dump_json()
