"""The step's stages as Prefect tasks: one thin task per stage function, nothing else (the
rollout and backward tasks also log their group's rewards, `names.rollout_line`/`backward_line`,
and the backward task shows its sweep's progress, `sweep_progress_artifact`).

Each task calls its stage (`longstraw.training.stages`) with the same arguments — configs and
refs — and returns its refs; Prefect adds retries, caching, names and the audit trail. A task
retried or run in another process gives the same result, because the stage rebuilds what its refs
name from storage.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator

import prefect
from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.context import TaskRunContext
from prefect.logging.loggers import task_run_logger

from longstraw.audit.names import (
    TASK_RUN_NAMES,
    WHERE,
    backward_line,
    group_tags,
    ranks_of,
    rollout_line,
    task_tags,
)
from longstraw.tasks.policies import (
    prefill_shard_cache_key,
    retry_on_transient,
    serializable_cache_policy,
)
from longstraw.training import evaluation, progress, stages
from longstraw.training.step import Stages

_RETRY = {"retries": 1, "retry_delay_seconds": 1, "retry_condition_fn": retry_on_transient}


def _task(name: str, **options):
    """A task named `name` whose runs are named and tagged for the UI (`audit.names`)."""
    return task(name=name, task_run_name=TASK_RUN_NAMES[name], tags=task_tags(name), **options)


def logging_line(line: Callable[[dict, object], str]):
    """The stage, logging `line(parameters, result)` to its task run's logger when it returns
    (an INFO line: the UI's task-run logs; `longstraw train` keeps it off the terminal). A call
    outside a task run (`.fn()`) logs nothing."""

    def wrap(stage):
        signature = inspect.signature(stage)

        @functools.wraps(stage)
        def run(*args, **kwargs):
            result = stage(*args, **kwargs)
            if TaskRunContext.get() is not None:
                parameters = signature.bind(*args, **kwargs).arguments
                get_run_logger().info(line(parameters, result))
            return result

        return run

    return wrap


SWEEP_ARTIFACT_INTERVAL_S = 2.0
"""Shortest wait between two updates of a backward task's sweep progress (a one-hour sweep of
256 shards updates it every shard; a tiny one does not flood the API)."""


def sweep_progress_artifact(stage):
    """The backward stage, showing its group's exact reverse sweep as a progress artifact of its
    task run: "sweep shards of group N" (swept / to sweep, the shards taken from a sweep
    checkpoint counted as swept), from the "sweep_shard" progress events (`training.progress`;
    relayed from another replica's ranks). A call outside a task run shows nothing."""
    signature = inspect.signature(stage)

    @functools.wraps(stage)
    def run(*args, **kwargs):
        if TaskRunContext.get() is None:
            return stage(*args, **kwargs)
        group = signature.bind(*args, **kwargs).arguments["rollout"].prompt.index
        # The events may come from the thread relaying another replica's: the artifact calls
        # run in this task run's context, one at a time.
        context, lock = contextvars.copy_context(), threading.Lock()
        shown = {"artifact": None, "at": 0.0}

        def show(done: int, total: int, resumed: int) -> None:
            value = 100.0 * done / max(total, 1)
            if shown["artifact"] is None:
                taken = f", {resumed} from a checkpoint" if resumed else ""
                shown["artifact"] = create_progress_artifact(
                    value, description=f"sweep shards of group {group} ({total}{taken})"
                )
            else:
                update_progress_artifact(shown["artifact"], value)

        def listen(event: str, fields: dict) -> None:
            if event != "sweep_shard" or fields["group"] != group:
                return
            with lock:
                now = time.monotonic()
                last = fields["done"] == fields["total"]
                if shown["artifact"] and not last and now - shown["at"] < SWEEP_ARTIFACT_INTERVAL_S:
                    return
                shown["at"] = now
                context.run(show, fields["done"], fields["total"], fields["resumed"])

        progress.add_listener(listen)
        try:
            return stage(*args, **kwargs)
        finally:
            progress.remove_listener(listen)

    return run


def log_cache_key(task, task_run, state) -> None:
    """Completion hook: the full cache key of a prefill shard, in the task run's logs (the name
    shows only the prompt digest's prefix). Computed or Cached, the key is the same."""
    context = TaskRunContext.get()
    key = prefill_shard_cache_key(context, context.parameters) if context else None
    task_run_logger(task_run, task).info("%s: cache key %s", state.name, key)


class HookChatterToDebug(logging.Filter):
    """Prefect logs two INFO lines around every hook it runs ("Running hook 'log_cache_key' in
    response to entering state 'Completed'", "Hook 'log_cache_key' finished running
    successfully"): half of a prefill shard's lines in the UI. This filter on the task-run
    logger makes those of LongStraw's own hooks DEBUG records, passed on only where that logger
    is set to DEBUG; a failing hook's error and other hooks' lines are untouched."""

    hooks = ("log_cache_key",)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not any(
            message.startswith(f"Running hook {hook!r} in response to entering state")
            or message == f"Hook {hook!r} finished running successfully"
            for hook in self.hooks
        ):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def _demote_hook_chatter() -> None:
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, HookChatterToDebug) for f in logger.filters):
        logger.addFilter(HookChatterToDebug())


# Here, where the hook is attached: every process that runs these tasks imports this module.
_demote_hook_chatter()

open_run = _task("open_run")(stages.open_run)
plan_step = _task("plan_step")(stages.plan_step)
# Cached per (run, weights, prompt, version, shard, config): a flow rerun after a crash skips
# every shard that finished; the storage manifest stays the source of truth.
prefill_shard = _task(
    "prefill_shard",
    cache_policy=serializable_cache_policy(),
    persist_result=True,
    result_serializer="json",
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=retry_on_transient,
    on_completion=[log_cache_key],
)(stages.prefill_shard)
prefill_prompt = _task("prefill_prompt", **_RETRY)(stages.prefill_prompt)
rollout_group = _task("rollout_group", **_RETRY)(logging_line(rollout_line)(stages.rollout_group))
score_group = _task("score_group", **_RETRY)(stages.score_group)
compute_advantages = _task("compute_advantages")(stages.compute_advantages)
backward_group = _task("backward_group", **_RETRY)(
    sweep_progress_artifact(logging_line(backward_line)(stages.backward_group))
)
reduce_gradients = _task("reduce_gradients", **_RETRY)(stages.reduce_gradients)
apply_update = _task("apply_update")(stages.apply_update)
write_checkpoint = _task("write_checkpoint", **_RETRY)(stages.write_checkpoint)
record_step = _task("record_step")(stages.record_step)
evaluate = _task("evaluate", **_RETRY)(evaluation.evaluate)


@contextlib.contextmanager
def group_labels(config, replica: int, prompt_index: int) -> Iterator[None]:
    """A group's tasks named and tagged with their group, replica and ranks (the replica only
    in the names of a run with several: one replica is every rank)."""
    size = config.parallel.sequence_ranks
    token = None
    if config.parallel.data_parallel > 1:
        token = WHERE.set(f"replica {replica} ({ranks_of(replica, size)})")
    try:
        with prefect.tags(*group_tags(replica, size, prompt_index)):
            yield
    finally:
        if token is not None:
            WHERE.reset(token)


def prefect_stages(on_prefill_shard=None) -> Stages:
    """The step's stages as these tasks (`longstraw.training.step.run_step` composes them)."""
    return Stages(
        plan_step=plan_step,
        prefill_shard=prefill_shard,
        prefill_prompt=prefill_prompt,
        rollout_group=rollout_group,
        score_group=score_group,
        compute_advantages=compute_advantages,
        backward_group=backward_group,
        reduce_gradients=reduce_gradients,
        apply_update=apply_update,
        write_checkpoint=write_checkpoint,
        record_step=record_step,
        on_prefill_shard=on_prefill_shard,
        evaluate=evaluate,
        for_group=group_labels,
    )
