"""Prefill tasks: one task run per shard (cached), then the commit of the whole state."""

from __future__ import annotations

import logging

from prefect import get_run_logger, task
from prefect.exceptions import MissingContextError
from pydantic import BaseModel, ConfigDict

from longstraw.schemas.refs import PromptRef, ShardRef
from longstraw.schemas.run import RunConfig
from longstraw.schemas.storage import PrefixStateRef
from longstraw.tasks import runtime
from longstraw.tasks.policies import retry_on_transient, serializable_cache_policy


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The task run's logger; a plain logger when called as `.fn()` outside any run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


@task(
    name="prefill_prompt_shard",
    cache_policy=serializable_cache_policy(),
    persist_result=True,
    result_serializer="json",
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=retry_on_transient,
)
def prefill_prompt_shard(
    config: RunConfig, prompt: PromptRef, shard: int, config_digest: str
) -> ShardRef:
    """Compute (or read back from storage) prefill shard `shard` of `prompt` and persist it.

    Cached on (weights digest, prompt digest, version, shard, config digest): a flow rerun after a
    crash skips every shard that finished; the storage manifest stays the source of truth (a
    later shard reads earlier ones back from storage when they are not in this process).
    """
    # Refused before any compute: a wrong shard index would prefill the whole prompt first, and
    # a digest or version that is not this run's would cache the shard under a key that lies.
    if not 0 <= shard < prompt.num_shards:
        raise ValueError(
            f"shard {shard} is out of range: prompt {prompt.prompt_id} has {prompt.num_shards} "
            "shards (plan_step gives the count)"
        )
    if config_digest != runtime.config_digest(config):
        raise ValueError(
            f"config_digest {config_digest!r} is not this config's "
            f"({runtime.config_digest(config)!r}): pass runtime.config_digest(config)"
        )
    ctx = runtime.run_context(config)
    if (prompt.policy_version, prompt.weights_digest) != (ctx.policy_version, ctx.weights_digest):
        raise ValueError(
            f"prompt {prompt.prompt_id} was planned at policy version {prompt.policy_version}, "
            f"the run is at version {ctx.policy_version}: plan the step again (plan_step)"
        )
    session = runtime.session(ctx, ctx.source(prompt.index))
    before = session.shards_computed
    with runtime.timed(config.run_id, "prefill"):
        session.ensure_shard(shard)
    computed = session.shards_computed > before
    runtime.emit(
        "prefill_shard", prompt=prompt.prompt_id, shard=shard, num_shards=prompt.num_shards
    )
    _logger().debug(
        "shard %d of %s: %s", shard, prompt.prompt_id, "computed" if computed else "read back"
    )
    return ShardRef(
        prompt_digest=prompt.prompt_digest,
        shard=shard,
        policy_version=prompt.policy_version,
        weights_digest=prompt.weights_digest,
        computed=computed,
    )


class PrefillReport(BaseModel):
    """A committed prompt state and how much of it this process computed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ref: PrefixStateRef | None
    """None when persistence is off."""
    shards_computed: int
    shards_reused: int
    """Shards read back from storage (a resumed or repeated prefill) instead of computed."""


@task(
    name="commit_prompt_state",
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=retry_on_transient,
)
def commit_prompt_state(config: RunConfig, prompt: PromptRef) -> PrefillReport:
    """Fill any shard still missing, verify and commit the state."""
    ctx = runtime.run_context(config)
    session = runtime.session(ctx, ctx.source(prompt.index))
    with runtime.timed(config.run_id, "prefill"):
        _, outcome = session.finish()
    return PrefillReport(
        ref=outcome.ref,
        shards_computed=outcome.shards_computed,
        shards_reused=outcome.shards_reused,
    )
