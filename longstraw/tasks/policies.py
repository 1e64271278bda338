"""Retry and cache policies shared by LongStraw's Prefect tasks."""

from __future__ import annotations

import hashlib

from prefect.cache_policies import CacheKeyFnPolicy

from longstraw.tasks.locks import CrashSafeFileLockManager

# Faults worth retrying: storage and network hiccups that no layer below explained. A
# ValueError (bad input) or a StateKeyMismatchError (wrong weights) fails the same way every
# time and is not retried; nor is a StorageFault (a UserError, so a ValueError): a full or
# read-only volume needs the operator, and an S3 fault comes after the S3 client's own attempts
# with backoff, whose bound a task retry would multiply by redoing the stage.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (OSError, ConnectionError, TimeoutError)


def retry_on_transient(task, task_run, state) -> bool:
    """Prefect retry condition: retry only transient faults."""
    try:
        state.result()
    except TRANSIENT_ERRORS:
        return True
    except BaseException:
        return False
    return False


def config_digest(config) -> str:
    """sha256 of the settings that change a prompt state (model, dtype, shard size)."""
    relevant = {
        "model": config.model.model_dump(mode="json"),
        "shard_tokens": config.engine.shard_tokens,
    }
    return hashlib.sha256(repr(sorted(relevant.items())).encode()).hexdigest()[:16]


def prefill_shard_cache_key(context, parameters) -> str:
    """(task name, run, weights digest, prompt digest, version, shard index, config digest).

    The run id is part of the key because the shard lives in the run's storage key space
    (`StateKey.policy`): a cache hit must mean "this run's storage holds the shard".
    """
    prompt = parameters["prompt"]
    return "-".join(
        (
            "prefill_shard",
            parameters["config"].run_id,
            prompt.weights_digest[:24],
            prompt.prompt_digest[:24],
            f"v{prompt.policy_version}",
            f"s{parameters['shard']}",
            config_digest(parameters["config"]),
        )
    )


def serializable_cache_policy() -> CacheKeyFnPolicy:
    """Cache on `prefill_shard_cache_key`; concurrent duplicates wait for the first writer."""
    return CacheKeyFnPolicy(cache_key_fn=prefill_shard_cache_key).configure(
        isolation_level="SERIALIZABLE",
        lock_manager=CrashSafeFileLockManager(),
    )
