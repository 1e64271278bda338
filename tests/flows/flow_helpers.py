"""Tiny training runs for the Prefect tests: a config builder, digests, and a varying reward.

The tiny runs use the qwen3_5 tiny checkpoint (hybrid: full attention + Gated DeltaNet), a
63-token prompt in 24-token shards (3 shards, the last one short), G = 3 responses of at most
2 tokens and a constant learning rate, so that a run of N steps resumed after step k follows the
very same optimizer trajectory as an uninterrupted one.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import yaml

from longstraw.models.checkpoint import read_checkpoint_metadata
from longstraw.schemas.data import HaystackTaskConfig
from longstraw.schemas.run import RunConfig
from longstraw.storage.checkpoints import latest_checkpoint

PROMPT_TOKENS = 63
SHARD_TOKENS = 24
NUM_SHARDS = 3
"""ceil((63 - 1) / 24): the state covers prompt_ids[:-1]."""
NUM_GENERATIONS = 3
REWARD_SPEC = "flow_helpers:text_checksum_reward"
"""Importable when tests/flows is on sys.path (pytest puts it there; subprocesses get PYTHONPATH)."""


_REWARD_CALLS = itertools.count()
"""Reward calls made in this process while a delay is set (rewards run on rank 0 only)."""
_CALLS_BEFORE_FAILURE = itertools.count()
"""Reward calls made in this process while a failure is armed."""


def text_checksum_reward(prompt: str, response: str, metadata: dict) -> float:
    """A deterministic reward that differs between responses.

    A random-weight model almost never earns the haystack reward, so every advantage (and every
    gradient) would be zero and weight digests could not tell runs apart; this one always varies.
    `LONGSTRAW_TEST_REWARD_DELAY_S` makes each call slow without changing its value: the crash
    test uses it to hold a step open, after its prompt state is committed, long enough to kill it.
    `LONGSTRAW_TEST_REWARD_DELAY_AFTER_CALLS` (default 0) leaves the process's first calls (the
    steps before the one the test holds open) undelayed. `LONGSTRAW_TEST_REWARD_FAIL_AFTER_CALLS`
    makes every call after that many fail (a run that fails mid-way).
    """
    fail_after = os.environ.get("LONGSTRAW_TEST_REWARD_FAIL_AFTER_CALLS")
    if fail_after is not None and next(_CALLS_BEFORE_FAILURE) >= int(fail_after):
        raise RuntimeError("the test's reward fails here (LONGSTRAW_TEST_REWARD_FAIL_AFTER_CALLS)")
    delay = float(os.environ.get("LONGSTRAW_TEST_REWARD_DELAY_S", "0"))
    if delay and next(_REWARD_CALLS) >= int(
        os.environ.get("LONGSTRAW_TEST_REWARD_DELAY_AFTER_CALLS", "0")
    ):
        time.sleep(delay)
    return (sum(response.encode()) % 11) / 10.0


def tiny_run_config(root: Path | str, run_id: str, num_steps: int = 2) -> RunConfig:
    return RunConfig.model_validate(tiny_run_dict(root, run_id, num_steps))


def tiny_run_dict(root: Path | str, run_id: str, num_steps: int = 2) -> dict:
    task = HaystackTaskConfig.tiny(num_prompt_tokens=PROMPT_TOKENS)
    return {
        "run_id": run_id,
        "engine": {"shard_tokens": SHARD_TOKENS, "prompt_grad": "exact"},
        "grpo": {
            "num_generations": NUM_GENERATIONS,
            "max_completion_length": 2,
            "learning_rate": 1e-2,
            "loss_type": "grpo",
        },
        "data": {
            "type": "haystack",
            "num_prompts": 4,
            "rewards": [REWARD_SPEC],
            "task": task.model_dump(mode="json"),
        },
        "train": {"num_steps": num_steps, "groups_per_step": 1, "checkpoint_every": 1},
        "storage": {"root_uri": str(root), "persist_mode": "synchronous"},
    }


def write_run_yaml(path: Path, root: Path | str, run_id: str, num_steps: int = 2) -> Path:
    path.write_text(yaml.safe_dump(tiny_run_dict(root, run_id, num_steps), sort_keys=False))
    return path


def final_weights_digest(config: RunConfig) -> str:
    """Weights digest recorded in the run's latest committed checkpoint."""
    path = latest_checkpoint(config.storage, config.run_id)
    assert path is not None, f"run {config.run_id} has no committed checkpoint"
    return read_checkpoint_metadata(path).weights_digest


# --- reading a flow run back through the Prefect API (the harness's, or a real server's) -------


def flow_run_ids(flow_run_id) -> list:
    """The flow run and its subflow runs (grpo_step inside train), recursively."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    found, frontier = [flow_run_id], [flow_run_id]
    with get_client(sync_client=True) as client:
        while frontier:
            children = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=frontier)
                )
            )
            frontier = [c.id for c in children if c.id not in found]
            found += frontier
    return found


def task_runs_of(flow_run_id) -> list:
    """Every task run of the flow run and its subflows, oldest first."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterSubFlowRuns,
    )

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=flow_run_ids(flow_run_id))),
            # Subflow runs appear as task runs of their parent: leave them out.
            task_run_filter=TaskRunFilter(subflow_runs=TaskRunFilterSubFlowRuns(exists_=False)),
        )
    return sorted(runs, key=lambda r: r.expected_start_time or r.created)


def artifacts_of(flow_run_id) -> list:
    """Every artifact created by the flow run and its subflows (and their tasks)."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=flow_run_ids(flow_run_id))
            )
        )


def latest_artifacts(flow_run_id) -> dict:
    """Key -> the newest version of each keyed artifact of the flow run (what the UI shows)."""
    newest: dict = {}
    for artifact in sorted(artifacts_of(flow_run_id), key=lambda a: a.created):
        if artifact.key:
            newest[artifact.key] = artifact
    return newest


def state_names(task_runs, task_name: str) -> list[str]:
    """State names of the task runs of `task_name` (task keys are `<function>-<source hash>`;
    run names are what the UI shows, e.g. `prefill s1/3 group 0 <digest>`)."""
    return [r.state.name for r in task_runs if r.task_key.rsplit("-", 1)[0] == task_name]


def logs_of(flow_run_id) -> list:
    """Every log line sent to the API by the flow run and its subflows (and their tasks)."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # the handler sends in batches, from a background thread
    with get_client(sync_client=True) as client:
        return client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=flow_run_ids(flow_run_id)))
        )


def artifact_versions(key: str) -> list:
    """Every version of the keyed artifact, oldest first (its history on the UI's artifact page)."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        versions = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )
    return sorted(versions, key=lambda a: a.created)
