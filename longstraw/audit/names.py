"""What the Prefect UI shows for a run: task run names, tags and the audit lines of a step.

Every name reads as what the task did, with the numbers a reader looks for — the shard, the group,
the policy version — and the prefill shards carry the prompt-state digest their cache is keyed by,
so a Cached shard in the UI says which committed state it reused. Names are built from the task's
bound parameters (Prefect passes them as `parameters`); nothing here imports torch.
"""

from __future__ import annotations

import contextvars
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

DIGEST_CHARS = 12
"""Digest prefix shown in names: enough to tell prompt states apart by eye, short enough to read."""

Parameters = dict[str, Any]


WHERE: contextvars.ContextVar[str | None] = contextvars.ContextVar("longstraw_where", default=None)
"""Where the group stages called in this context run ("replica 1 (ranks 2-3)"), set around a
data-parallel replica's group (`group_labels`); None: on every rank."""


def _named(build: Callable[[Parameters], str]) -> Callable[..., str]:
    # Prefect calls a task_run_name callable with `parameters=` when its signature has that name.
    def task_run_name(parameters: Parameters) -> str:
        where = WHERE.get()
        return build(parameters) if where is None else f"{build(parameters)} on {where}"

    return task_run_name


def ranks_of(replica: int, sequence_ranks: int) -> str:
    """ "ranks 2-3" (or "rank 2"): the global ranks of a replica of `sequence_ranks`."""
    first, last = replica * sequence_ranks, (replica + 1) * sequence_ranks - 1
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def group_tags(replica: int, sequence_ranks: int, prompt_index: int) -> tuple[str, ...]:
    """Tags of a group's tasks: the group (its prompt's run-wide index), the replica that ran it
    and that replica's ranks — filter the UI by `replica:1` to see what one replica did."""
    ranks = ranks_of(replica, sequence_ranks).split()[-1]
    return (f"group:{prompt_index}", f"replica:{replica}", f"ranks:{ranks}")


def _prefill_shard(p: Parameters) -> str:
    prompt = p["prompt"]
    return (
        f"prefill s{p['shard']}/{prompt.num_shards} group {prompt.index} "
        f"{prompt.prompt_digest[:DIGEST_CHARS]}"
    )


def _prefill_prompt(p: Parameters) -> str:
    prompt = p["prompt"]
    return (
        f"prefill group {prompt.index} ({prompt.num_shards} shards) "
        f"{prompt.prompt_digest[:DIGEST_CHARS]}"
    )


def _backward(p: Parameters) -> str:
    # The prompt's run-wide index, as prefill and rollout name it (`group` is the position in
    # the step's plan).
    iteration = p.get("iteration", 0)
    return f"backward group {p['rollout'].prompt.index}" + (
        f" iteration {iteration}" if iteration else ""
    )


TASK_RUN_NAMES: dict[str, Callable[..., str]] = {
    "open_run": _named(lambda p: f"open {p['config'].run_id}"),
    "plan_step": _named(lambda p: f"plan step {p['policy'].step}"),
    "prefill_shard": _named(_prefill_shard),
    "prefill_prompt": _named(_prefill_prompt),
    "rollout_group": _named(lambda p: f"rollout group {p['prompt'].index}"),
    "score_group": _named(lambda p: f"score {p['which']} group {p['rollout'].prompt.index}"),
    "compute_advantages": _named(lambda p: f"advantages of {len(p['rollouts'])} groups"),
    "backward_group": _named(_backward),
    "reduce_gradients": _named(lambda p: f"reduce {len(p['grads'])} gradients"),
    "apply_update": _named(
        lambda p: f"update v{p['policy'].policy_version} to v{p['policy'].policy_version + 1}"
    ),
    "write_checkpoint": _named(lambda p: f"checkpoint v{p['policy'].policy_version}"),
    "record_step": _named(lambda p: f"record step {p['metrics'].step}"),
    "evaluate": _named(lambda p: f"evaluate v{p['policy'].policy_version}"),
}
"""Task name → its task_run_name callable."""

STAGE_TAGS: dict[str, str] = {
    "open_run": "open",
    "plan_step": "plan",
    "prefill_shard": "prefill",
    "prefill_prompt": "prefill",
    "rollout_group": "rollout",
    "score_group": "score",
    "compute_advantages": "advantages",
    "backward_group": "backward",
    "reduce_gradients": "reduce",
    "apply_update": "update",
    "write_checkpoint": "checkpoint",
    "record_step": "record",
    "evaluate": "eval",
}
"""Task name → the stage it belongs to (tagged `stage:<stage>`)."""

GPU_TAG = "gpu"
"""Tag of the tasks that run the model: a Prefect tag concurrency limit on it
(`prefect concurrency-limit create gpu 1`) bounds how many of them run at once across runs."""

GPU_TASKS = frozenset(
    {
        "prefill_shard",
        "prefill_prompt",
        "rollout_group",
        "score_group",
        "backward_group",
        "reduce_gradients",
        "apply_update",
        "evaluate",
    }
)


def task_tags(task_name: str) -> set[str]:
    """Static tags of one task: its stage, and `gpu` for the tasks that run the model."""
    tags = {f"stage:{STAGE_TAGS[task_name]}"}
    if task_name in GPU_TASKS:
        tags.add(GPU_TAG)
    return tags


def run_tags(run_id: str) -> tuple[str, ...]:
    """Tags of every flow run of a training run (the train flow, its step subflows): filter the
    Runs list by `run:<id>` to see a run, its failures and its resumes."""
    return (f"run:{run_id}",)


def step_tags(run_id: str, step: int, policy_version: int) -> tuple[str, ...]:
    """Tags one step's subflow and every task of it carries: which run, which step, which policy
    version."""
    return (*run_tags(run_id), f"step:{step}", f"policy:v{policy_version}")


def step_flow_run_name(run_id: str, step: int) -> str:
    """The step subflow's name: `<run_id>/step-0007` (steps sort in order, runs apart)."""
    return f"{run_id}/step-{step:04d}"


def rewards_summary(rewards: Sequence[float]) -> str:
    """A group's [G] rewards in one phrase: mean, std (the sample std, as the step's
    `reward_std`), min and max, 4 significant digits."""
    std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    return (
        f"rewards mean {statistics.fmean(rewards):.4g} std {std:.4g} "
        f"min {min(rewards):.4g} max {max(rewards):.4g} over {len(rewards)} responses"
    )


def rollout_line(parameters: Parameters, rollout) -> str:
    """What a rollout task run logs: its group's rewards (the group numbered as in its name)."""
    return f"group {rollout.prompt.index}: {rewards_summary(rollout.rewards)}"


def backward_line(parameters: Parameters, result) -> str:
    """What a backward task run logs: its group's rewards, its share of the step's loss and the
    completion tokens the loss counted."""
    rollout = parameters["rollout"]
    return (
        f"group {rollout.prompt.index}: {rewards_summary(rollout.rewards)}; "
        f"loss {result.stats.loss:.4g} over {sum(result.stats.num_tokens)} tokens"
    )


def round_significant(value: float, digits: int = 4) -> float:
    """`value` to `digits` significant digits (what a table in the UI shows)."""
    return float(f"{value:.{digits}g}")


def rounded_rows(rows: Iterable[dict[str, Any]], digits: int = 4) -> list[dict[str, Any]]:
    """Table rows with every float rounded to `digits` significant digits (ints, strings kept)."""
    return [
        {k: round_significant(v, digits) if isinstance(v, float) else v for k, v in row.items()}
        for row in rows
    ]


def metrics_row(metrics) -> dict[str, Any]:
    """A step's `StepMetrics` as one flat table row (without its seconds): its evaluation, when
    the step had one, as `eval_<field>` columns (every completion's reward left out)."""
    row = metrics.model_dump(mode="json", exclude={"seconds", "eval"})
    if metrics.eval is not None:
        row |= {
            f"eval_{k}": v
            for k, v in metrics.eval.model_dump(mode="json", exclude={"rewards"}).items()
        }
    return row


def artifact_key(run_id: str) -> str:
    """A run's artifact key prefix: Prefect artifact keys allow lowercase letters, digits and
    dashes only."""
    return "".join(c if c.isalnum() else "-" for c in run_id.lower())
