"""One GRPO step, composed once from its stages; the loop and the Prefect flow both run it.

`run_step(config, policy, stages)` calls each stage through `stages`: `IN_PROCESS` (the stage
functions themselves) or the Prefect tasks wrapping them one to one (`longstraw.tasks`). The
composition — which prompts, which stage after which, the normalisers, the step counter, the
checkpoint cadence, the metrics — exists only here.

With `parallel.data_parallel: R` the step's groups are spread over the replicas (`replica_lanes`)
and each replica's groups run in a driver thread of their own, its lane (`across_replicas`), so
the replicas compute at once; the stages that span the groups (advantages, reduction, update,
checkpoint) wait for every lane. A group stage that finished is recorded (`finished_groups`):
a resumed run takes it as it was instead of computing it again.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from longstraw.distributed import replica_gradients
from longstraw.distributed.stage_group import on_replica, replicas_serving
from longstraw.grpo.optim import UpdateStats
from longstraw.schemas.refs import PolicyRef, UpdateResult
from longstraw.schemas.results import GroupStats, StateTraffic, StepMetrics
from longstraw.schemas.run import RunConfig
from longstraw.trackers.completions import write_completions
from longstraw.training import evaluation as _evaluation
from longstraw.training import finished_groups, progress
from longstraw.training import stages as _stages
from longstraw.training.sweep_checkpoints import discard_sweep_checkpoints


def _no_labels(config: RunConfig, replica: int, index: int) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Stages:
    """The callables a step is made of (each with the signature of the stage it names)."""

    plan_step: Callable
    prefill_shard: Callable
    prefill_prompt: Callable
    rollout_group: Callable
    score_group: Callable
    compute_advantages: Callable
    backward_group: Callable
    reduce_gradients: Callable
    apply_update: Callable
    write_checkpoint: Callable
    record_step: Callable
    on_prefill_shard: Callable[[int, int], None] | None = None
    """Progress callback (shards done, shards in the step)."""
    evaluate: Callable = _evaluation.evaluate
    """The held-out prompts' evaluation (`train.eval_steps`)."""
    ready_to_compute: Callable = _stages.ready_to_compute
    """Every rank holds the policy, gathered (before the replicas' lanes start)."""
    for_group: Callable[[RunConfig, int, int], contextlib.AbstractContextManager] = _no_labels
    """`for_group(config, replica, prompt_index)`: a block around a group's stage calls that
    labels them (the Prefect tasks' names and tags)."""


IN_PROCESS = Stages(
    plan_step=_stages.plan_step,
    prefill_shard=_stages.prefill_shard,
    prefill_prompt=_stages.prefill_prompt,
    rollout_group=_stages.rollout_group,
    score_group=_stages.score_group,
    compute_advantages=_stages.compute_advantages,
    backward_group=_stages.backward_group,
    reduce_gradients=_stages.reduce_gradients,
    apply_update=_stages.apply_update,
    write_checkpoint=_stages.write_checkpoint,
    record_step=_stages.record_step,
)


def replica_lanes(prompts, replicas: int) -> list[list[int]]:
    """[R] the step's group positions each replica runs, in order: group i on replica i mod R,
    except that a prompt the step holds twice stays on the replica that took it first (no two
    replicas compute and commit one prompt state at once)."""
    lanes: list[list[int]] = [[] for _ in range(replicas)]
    home: dict[str, int] = {}
    for g, prompt in enumerate(prompts):
        lanes[home.setdefault(prompt.prompt_digest, g % replicas)].append(g)
    return lanes


def across_replicas(
    config: RunConfig, policy: PolicyRef, prompts, stages: Stages, work: Callable[[int], object]
) -> list:
    """[groups] `work(g)` for each group position g: in order on one process or one replica;
    with R replicas, each replica's groups in a lane of its own, the lanes at once. A lane that
    fails stops the others at their next group; its error is raised once all have stopped."""
    lanes = replica_lanes(prompts, config.parallel.data_parallel)
    results: list = [None] * len(prompts)
    if config.parallel.data_parallel == 1:
        for g in lanes[0]:
            with stages.for_group(config, 0, prompts[g].index):
                results[g] = work(g)
        return results
    failed = threading.Event()

    def run_lane(d: int) -> None:
        with on_replica(d):
            for g in lanes[d]:
                if failed.is_set():
                    return
                try:
                    with stages.for_group(config, d, prompts[g].index):
                        results[g] = work(g)
                except BaseException:
                    failed.set()
                    raise

    stages.ready_to_compute(config, policy)
    with replicas_serving():
        with ThreadPoolExecutor(len(lanes)) as pool:
            # Each lane in a copy of this context: Prefect's flow run (and its tags) go with it.
            futures = [
                pool.submit(contextvars.copy_context().run, run_lane, d) for d in range(len(lanes))
            ]
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
    return results


def on_first_replica(config: RunConfig, policy: PolicyRef, stages: Stages, call: Callable):
    """`call()`'s stages on replica 0's ranks (a stage outside the step's groups, such as the
    evaluation: its prompt states are sharded as the groups' are); as they are with one."""
    if config.parallel.data_parallel == 1:
        return call()
    stages.ready_to_compute(config, policy)
    with replicas_serving(), on_replica(0):
        return call()


class _ShardCount:
    """Prefill shards done out of a step's total, told to progress as lanes finish them."""

    def __init__(self, prompts, stages: Stages):
        self.total = sum(p.num_shards for p in prompts)
        self.done = 0
        self.lock = threading.Lock()
        self.stages = stages

    def add_one(self) -> None:
        with self.lock:
            self.done += 1
            progress.emit("prefill_shard", done=self.done, total=self.total)
            if self.stages.on_prefill_shard is not None:
                self.stages.on_prefill_shard(self.done, self.total)


def _prefill(config: RunConfig, policy: PolicyRef, prompt, stages: Stages, count: _ShardCount):
    """(report, seconds) of a prompt's state: shard by shard (one cacheable stage call each, on
    one process or on the ranks of its replica), then the commit."""
    started = time.perf_counter()
    for shard in range(prompt.num_shards):
        stages.prefill_shard(config, policy, prompt, shard)
        count.add_one()
    report = stages.prefill_prompt(config, policy, prompt)
    return report, time.perf_counter() - started


def _prefilled_rollout(config: RunConfig, policy: PolicyRef, prompt, stages: Stages, count):
    """(prefill report, its seconds, rollout) of one group."""
    report, seconds = _prefill(config, policy, prompt, stages, count)
    record = finished_groups.rollout(config, policy, prompt)
    found, rollout = record.read()
    if not found:
        rollout = record.write(stages.rollout_group(config, policy, prompt))
    return report, seconds, rollout


def _scores(config: RunConfig, policy: PolicyRef, rollout, stages: Stages):
    """(reference, old) scores of one group: None where beta = 0 / num_iterations = 1."""

    def score(which: str):
        record = finished_groups.scores(config, policy, rollout, which)
        found, scores = record.read()
        if not found:
            scores = record.write(stages.score_group(config, policy, rollout, which))
        return scores

    ref = score("reference") if config.grpo.beta > 0 else None
    # More than one update per rollout needs the rollout policy's log-probs (no-grad replay).
    old = score("old") if config.grpo.num_iterations > 1 else None
    return ref, old


def run_step(
    config: RunConfig, policy: PolicyRef, stages: Stages = IN_PROCESS
) -> tuple[PolicyRef, StepMetrics]:
    """Step `policy.step`: rollout every group, then `num_iterations` updates on those
    rollouts; a checkpoint when the cadence asks. Returns the new policy and the step's record."""
    seconds: dict[str, float] = {}

    def add(stage: str, value: float) -> None:
        seconds[stage] = seconds.get(stage, 0.0) + value

    step_started, summed = time.perf_counter(), replica_gradients.TRAFFIC["bytes"]
    prompts = stages.plan_step(config, policy)
    count = _ShardCount(prompts, stages)
    done = across_replicas(
        config, policy, prompts, stages,
        lambda g: _prefilled_rollout(config, policy, prompts[g], stages, count),
    )  # fmt: skip
    reports = [report for report, _, _ in done]
    rollouts = [rollout for _, _, rollout in done]
    # Seconds are summed over the groups, as every stage's are (replicas overlap them).
    add("prefill", sum(seconds for _, seconds, _ in done))
    for rollout in rollouts:
        for stage, value in rollout.seconds.items():
            add(stage, value)
    plan = stages.compute_advantages(config, rollouts)
    scores = across_replicas(
        config, policy, prompts, stages, lambda g: _scores(config, policy, rollouts[g], stages)
    )
    refs = [ref for ref, _ in scores]
    olds = [old for _, old in scores]
    add("reference", sum(s.seconds for s in refs if s is not None))
    add("score_old", sum(s.seconds for s in olds if s is not None))

    # What the tiered prompt state (engine.state_budget_bytes) held and moved, stage by stage.
    traffic = [r.state_traffic for r in rollouts]
    traffic += [s.state_traffic for s in (*refs, *olds) if s is not None]
    current = policy
    group_stats: list[GroupStats] = []
    sweep_shards = [0, 0]  # (computed, resumed) over every iteration's sweeps
    update: UpdateResult | None = None
    for iteration in range(config.grpo.num_iterations):
        if iteration > 0:
            # The weights changed: the prompt states of the new version.
            again = stages.plan_step(config, current)
            count = _ShardCount(again, stages)
            prefilled = across_replicas(
                config, current, again, stages,
                lambda g, at=current, again=again, count=count: _prefill(
                    config, at, again[g], stages, count
                ),
            )  # fmt: skip
            reports += [report for report, _ in prefilled]
            add("prefill", sum(seconds for _, seconds in prefilled))

        def backward(g: int, at=current, iteration=iteration):
            record = finished_groups.backward(
                config, at, rollouts[g], plan, refs[g], olds[g], iteration
            )
            found, result = record.read()
            if not found:
                with progress.relayed("sweep_shard", rollouts[g].prompt.index):
                    result = record.write(
                        stages.backward_group(
                            config, at, rollouts[g], plan, g, refs[g], olds[g], iteration
                        )
                    )
            # Its result is recorded: its sweep checkpoints are of no more use.
            discard_sweep_checkpoints(config, at, rollouts[g].prompt.index)
            return result

        results = across_replicas(config, current, prompts, stages, backward)
        group_stats = [r.stats for r in results]
        sweep_shards[0] += sum(s.sweep_shards_computed for s in group_stats)
        sweep_shards[1] += sum(s.sweep_shards_resumed for s in group_stats)
        traffic += [s.state_traffic for s in group_stats]
        for stats in group_stats:
            add("replay", stats.seconds.replay)
            add("sweep", stats.seconds.sweep)
        total = stages.reduce_gradients(config, current, [r.grad for r in results], iteration)
        update = stages.apply_update(config, current, total)
        add("update", update.seconds)
        current = update.policy
    current = current.model_copy(update={"step": policy.step + 1})
    records = [_stages.rollout_record(r) for r in rollouts]
    metrics = step_metrics(
        step=policy.step,
        policy_version=policy.policy_version,
        rewards=torch.tensor([r.rewards for r in rollouts], dtype=torch.float64),
        advantages=torch.tensor(plan.advantages, dtype=torch.float64),
        group_stats=group_stats,
        update=update,
        prompt_tokens=sum(p.num_tokens for p in prompts),
        num_items=plan.num_items_in_batch,
        truncated=[t for r in records for t in r.truncated],
        completion_lengths=[n for r in records for n in completion_lengths(r)],
        seconds=seconds,
        shards_computed=sum(r.shards_computed for r in reports),
        shards_reused=sum(r.shards_reused for r in reports),
        state_traffic=traffic,
        sweep_shards=sweep_shards,
    )
    if config.agent is not None:
        metrics = metrics.model_copy(update=agent_metrics(records))
    if config.tracking.completions_per_step:
        # The step's completions table, for the trackers and the Prefect UI.
        write_completions(config, policy.step, records, plan.advantages)
    if _evaluation.is_eval_step(config, current.step):
        # The weights this step made, before its checkpoint: the row the checkpoint carries
        # holds the evaluation too, so a resume never evaluates a recorded step again.
        started = time.perf_counter()
        evaluated = on_first_replica(
            config, current, stages, lambda: stages.evaluate(config, current)
        )
        add("eval", time.perf_counter() - started)
        metrics = metrics.model_copy(update={"eval": evaluated, "seconds": dict(seconds)})
    if _stages.is_checkpoint_step(config, current.step):
        # The checkpoint carries the step's record (without its own time): a process killed
        # between this commit and `record_step` gets the row back on resume.
        started = time.perf_counter()
        current = stages.write_checkpoint(config, current, metrics)
        add("checkpoint", time.perf_counter() - started)
        metrics = metrics.model_copy(update={"seconds": dict(seconds)})
    metrics = metrics.model_copy(
        update={
            "step_seconds": time.perf_counter() - step_started,
            # Counted on the driver; every rank sends as much.
            "replica_sum_bytes": replica_gradients.TRAFFIC["bytes"] - summed,
        }
    )
    metrics = stages.record_step(config, metrics)
    progress.emit("step", step=metrics.step)
    return current, metrics


def agent_metrics(records) -> dict:
    """The agent fields of a step's metrics, from its rollout records."""
    turns = [n for r in records for n in (r.num_turns or [])]
    return {
        "turns_mean": sum(turns) / len(turns) if turns else 0.0,
        "environment_errors": sum(e is not None for r in records for e in (r.errors or [])),
    }


def completion_lengths(record) -> list[int]:
    """[G] tokens the policy sampled in each response of a rollout record (TRL's completion
    length: a loss mask's given tokens, an agent's observations, are not counted)."""
    if record.loss_masks is not None:
        return [sum(mask) for mask in record.loss_masks]
    return [len(ids) for ids in record.response_ids]


def _std(values: torch.Tensor) -> float:
    return float(values.std()) if values.numel() > 1 else 0.0


def step_metrics(
    *,
    step: int,
    policy_version: int,
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    group_stats: list[GroupStats],
    update: UpdateStats | UpdateResult,
    prompt_tokens: int,
    num_items: float,
    truncated: list[bool],
    seconds: dict[str, float],
    shards_computed: int,
    shards_reused: int,
    state_traffic: list[StateTraffic | None] = (),
    completion_lengths: list[int] = (),
    sweep_shards: tuple[int, int] = (0, 0),
) -> StepMetrics:
    """The audit record of one step (`rewards`/`advantages` [groups, G]; `state_traffic` one
    entry per stage that read a prompt state, None where it was resident; `completion_lengths`
    one entry per response; `sweep_shards` the exact sweeps' shards (computed, resumed from
    checkpoints))."""
    kls = [s.kl for s in group_stats if s.kl is not None]
    # A group whose rewards are all equal has zero advantages (TRL's frac_reward_zero_std).
    flat_groups = (rewards == rewards[:, :1]).all(dim=1)
    tiered = [t for t in state_traffic if t is not None]
    count = max(len(group_stats), 1)
    return StepMetrics(
        step=step,
        policy_version=policy_version,
        reward_mean=float(rewards.mean()),
        reward_std=_std(rewards.flatten()),
        frac_reward_zero_std=float(flat_groups.double().mean()),
        advantage_mean=float(advantages.mean()),
        advantage_std=_std(advantages.flatten()),
        advantage_min=float(advantages.min()),
        advantage_max=float(advantages.max()),
        loss=sum(s.loss for s in group_stats),
        kl=sum(kls) / len(kls) if kls else None,
        clip_ratio_low=sum(s.clip_ratio_low for s in group_stats) / count,
        clip_ratio_high=sum(s.clip_ratio_high for s in group_stats) / count,
        clip_ratio_region=sum(s.clip_ratio_region for s in group_stats) / count,
        grad_norm=update.grad_norm,
        learning_rate=update.learning_rate,
        prompt_tokens=prompt_tokens,
        completion_tokens=int(num_items),
        completion_length_mean=(
            sum(completion_lengths) / len(completion_lengths) if completion_lengths else None
        ),
        completion_length_min=min(completion_lengths, default=None),
        completion_length_max=max(completion_lengths, default=None),
        num_groups=rewards.shape[0],
        truncated_fraction=sum(truncated) / max(len(truncated), 1),
        seconds=seconds,
        peak_rss_bytes=max(s.peak_rss_bytes for s in group_stats) if group_stats else 0,
        trainable_parameters=getattr(update, "trainable_parameters", None),
        shards_computed=shards_computed,
        shards_reused=shards_reused,
        sweep_shards_computed=sweep_shards[0],
        sweep_shards_resumed=sweep_shards[1],
        state_bytes=max((s.state_bytes for s in group_stats), default=None),
        state_peak_resident_bytes=max((t.peak_resident_bytes for t in tiered), default=None),
        state_bytes_read=sum(t.bytes_read for t in tiered),
        state_bytes_written=sum(t.bytes_written for t in tiered),
    )
