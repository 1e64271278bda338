"""A Prefect task that runs one group's gradient sequence-sharded over local ranks.

The task starts the process group on the worker it runs on (`torch.multiprocessing`, rendezvous
on 127.0.0.1 — gloo on CPU, NCCL on GPUs), every rank prefills its part of the prompt and joins
the replay and the exact sweep, and rank 0 writes the reduced fp32 gradient as safetensors. The
task returns a `GradRef` to that file: tensors never pass through Prefect.

With `storage` and `state_key` set, every rank records its own prefill shards as it computes them
(`persisted_sharded_prefill`). A rank that dies fails the task with `RankFailedError`; the task's
retry (only for a rank that died, not one that raised) resumes at the first unrecorded shard.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

import torch
from prefect import task
from pydantic import BaseModel, ConfigDict, model_validator

from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.refs import GradRef, TensorSpec
from longstraw.schemas.storage import StateKey, StorageConfig
from longstraw.tasks.policies import TRANSIENT_ERRORS


class ShardedGroupJob(BaseModel):
    """Everything the ranks need to compute one group's gradient."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    checkpoint: str
    """Hugging Face checkpoint directory every rank loads."""
    policy_version: int
    prompt_ids: list[int]
    responses: list[list[int]]
    advantages: list[float]
    grpo: GRPOConfig
    shard_tokens: int
    prompt_grad: str = "exact"
    world_size: int = 2
    backend: str = "gloo"
    output_dir: str
    """Where rank 0 writes `grads-<digest>.safetensors`."""
    storage: StorageConfig | None = None
    """Where the ranks record the prompt state shard by shard (None: kept in memory only)."""
    state_key: StateKey | None = None
    """The prompt state's key in `storage` (required with it)."""
    schedule: Literal["sequential", "wavefront"] = "sequential"
    """Prefill schedule (docs/scaling.md "Schedule"): "wavefront" keeps every rank computing
    (bitwise the same state); "sequential" one shard at a time."""

    @model_validator(mode="after")
    def _key_with_storage(self) -> ShardedGroupJob:
        if self.storage is not None and self.state_key is None:
            raise ValueError(
                "storage is set but state_key is not: give the prompt state's StateKey "
                "(StateKey.policy(run_id, version, weights_digest, prompt_digest))"
            )
        return self


def retry_on_rank_death(task, task_run, state) -> bool:
    """Prefect retry condition: transient faults and ranks that died (killed, OOM, preempted).

    A rank that raised (bad input, a state mismatch) would fail the same way again.
    """
    from longstraw.distributed.launch import RankFailedError

    try:
        state.result()
    except TRANSIENT_ERRORS:
        return True
    except RankFailedError as failure:
        return failure.exit_code is not None
    except BaseException:
        return False
    return False


def _rank_gradient(rank: int, world_size: int, job: ShardedGroupJob) -> dict | None:
    """Runs on every rank: sharded prefill, replay and sweep; rank 0 writes the gradient."""
    from safetensors.torch import save_file

    from longstraw.distributed.persisted_sharded_prefill import persisted_sharded_prefill
    from longstraw.distributed.sharded_group import sharded_group_gradients
    from longstraw.distributed.sharded_prefill import sharded_prefill
    from longstraw.distributed.wavefront_prefill import wavefront_prefill
    from longstraw.models.checkpoint import load_checkpoint

    model, _, _ = load_checkpoint(job.checkpoint, dtype=torch.float32)
    model.eval()
    prompt = torch.tensor(job.prompt_ids)
    if job.storage is None:
        prefill = wavefront_prefill if job.schedule == "wavefront" else sharded_prefill
        state = prefill(model, prompt, shard_tokens=job.shard_tokens)
    else:
        state, _ = persisted_sharded_prefill(
            model, prompt, shard_tokens=job.shard_tokens, storage=job.storage, key=job.state_key,
            schedule=job.schedule,
        )  # fmt: skip
    grads, _ = sharded_group_gradients(
        model,
        state,
        [torch.tensor(r) for r in job.responses],
        torch.tensor(job.advantages),
        job.grpo,
        prompt_grad=job.prompt_grad,
    )
    if rank != 0:
        return None
    tensors = {name: g.contiguous() for name, g in grads.grads.items()}
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].view(torch.uint8).numpy().tobytes())
    path = Path(job.output_dir) / f"grads-{digest.hexdigest()[:16]}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return {
        "path": str(path),
        "digest": digest.hexdigest(),
        "specs": [(n, tuple(t.shape), "float32") for n, t in sorted(tensors.items())],
    }


@task(name="sharded_backward_group", retries=1, retry_condition_fn=retry_on_rank_death)
def sharded_backward_group(job: ShardedGroupJob) -> GradRef:
    """One group's gradient with the prompt state split over `job.world_size` local ranks."""
    from longstraw.distributed.launch import run_on_ranks

    results = run_on_ranks(_rank_gradient, job.world_size, job, backend=job.backend)
    written = results[0]
    return GradRef(
        uri=f"file://{written['path']}",
        digest=written["digest"],
        policy_version=job.policy_version,
        specs=tuple(TensorSpec(name=n, shape=s, dtype=d) for n, s, d in written["specs"]),
        num_tokens=sum(len(r) for r in job.responses),
    )


def load_grad_file(ref: GradRef) -> dict[str, torch.Tensor]:
    """The tensors behind a file:// GradRef."""
    from safetensors.torch import load_file

    if not ref.uri.startswith("file://"):
        raise ValueError(f"{ref.uri} is not a gradient file")
    return load_file(ref.uri.removeprefix("file://"))
