"""What tasks of one process share: open runs, prefill sessions, rollouts, gradient buffers.

Tasks pass small refs; the tensors behind them live here, so the single-machine path pays no
I/O. Everything here can be rebuilt after a crash: runs from their latest checkpoint, prompt
states from storage (committed states and shard manifests), rollouts by recomputation.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import torch

from longstraw.engine.group import GradBuffer
from longstraw.schemas.refs import GradRef, TensorSpec
from longstraw.schemas.run import RunConfig
from longstraw.training.context import RunContext, open_run
from longstraw.training.persisted_prefill import PrefillSession
from longstraw.training.prompts import PromptExample
from longstraw.training.step import GroupRollout, policy_key

_lock = threading.RLock()
_runs: dict[str, RunContext] = {}
_sessions: dict[str, PrefillSession] = {}
_rollouts: dict[str, GroupRollout] = {}
_grads: dict[str, GradBuffer] = {}
group_stats: dict[str, object] = {}
"""GroupStats of each backward_group, by GradRef uri (the flow's audit table reads them)."""
_listeners: list[Callable[[str, dict], None]] = []


def config_digest(config: RunConfig) -> str:
    """sha256 of the settings that change a prompt state (model, dtype, shard size)."""
    relevant = {
        "model": config.model.model_dump(mode="json"),
        "shard_tokens": config.engine.shard_tokens,
    }
    return hashlib.sha256(repr(sorted(relevant.items())).encode()).hexdigest()[:16]


def start_run(config: RunConfig, *, resume: bool) -> RunContext:
    """Open run `config.run_id` in this process (fresh, or from its latest checkpoint)."""
    with _lock:
        forget_run(config.run_id)
        ctx = open_run(config, resume=resume)
        _runs[config.run_id] = ctx
        return ctx


def run_context(config: RunConfig) -> RunContext:
    """The open run `config.run_id`; a process that has not opened it yet (a task retried or
    run elsewhere) resumes it from its latest checkpoint."""
    from longstraw.storage.checkpoints import latest_checkpoint

    with _lock:
        ctx = _runs.get(config.run_id)
        if ctx is None or ctx.config != config:
            resume = latest_checkpoint(config.storage, config.run_id) is not None
            ctx = open_run(config, resume=resume)
            _runs[config.run_id] = ctx
        return ctx


def forget_run(run_id: str) -> None:
    with _lock:
        _runs.pop(run_id, None)
        for name in [k for k in _sessions if k.startswith(f"{run_id}/")]:
            _sessions.pop(name).close()
        for name in [k for k in _rollouts if k.startswith(f"{run_id}/")]:
            _rollouts.pop(name)


def session(ctx: RunContext, example: PromptExample) -> PrefillSession:
    """The prefill session of `example` at the run's current policy version."""
    key = policy_key(ctx, example)
    name = f"{ctx.config.run_id}/v{ctx.policy_version}/{example.digest}"
    with _lock:
        found = _sessions.get(name)
        if found is None:
            found = PrefillSession(
                ctx.model,
                example.prompt_ids,
                shard_tokens=ctx.config.engine.shard_tokens,
                storage=ctx.config.storage,
                key=key,
            )
            _sessions[name] = found
        return found


def drop_sessions_before(run_id: str, policy_version: int) -> None:
    """Free the states of older policy versions (they are invalid for the new weights)."""
    with _lock:
        for name in list(_sessions):
            run, version, _ = name.split("/", 2)
            if run == run_id and int(version[1:]) < policy_version:
                _sessions.pop(name).close()


def put_rollout(ctx: RunContext, rollout: GroupRollout) -> str:
    name = f"{ctx.config.run_id}/{uuid.uuid4().hex}"
    with _lock:
        _rollouts[name] = rollout
    return name


def get_rollout(name: str) -> GroupRollout:
    with _lock:
        return _rollouts[name]


def _fingerprint(tensor: torch.Tensor) -> list[float]:
    """Sum, sum of magnitudes and L2 norm in fp64, computed where the tensor lives."""
    stats = torch.stack(
        [
            tensor.sum(dtype=torch.float64),
            tensor.abs().sum(dtype=torch.float64),
            torch.linalg.vector_norm(tensor, dtype=torch.float64),
        ]
    )
    return stats.cpu().tolist()


def put_grads(grads: GradBuffer, *, policy_version: int, num_tokens: int) -> GradRef:
    """Register a gradient contribution in-process; its ref carries a digest of its content.

    The digest hashes names, shapes and per-tensor fp64 sums, magnitudes and norms, computed on
    the tensors' device: hashing every byte (sha256 of a 27 B-parameter fp32 gradient: ~55 s of
    CPU per step, after copying it to the host) would put a full gradient pass on the hot path.
    Identical contributions compare equal; a retry that double-counted would not.
    """
    digest = hashlib.sha256()
    specs = []
    for name, tensor in sorted(grads.grads.items()):
        digest.update(name.encode())
        digest.update(repr((tuple(tensor.shape), _fingerprint(tensor))).encode())
        specs.append(
            TensorSpec(
                name=name, shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch.")
            )
        )
    ref_id = uuid.uuid4().hex
    with _lock:
        _grads[ref_id] = grads
    return GradRef(
        uri=f"memory://grads/{ref_id}",
        digest=digest.hexdigest(),
        policy_version=policy_version,
        specs=tuple(specs),
        num_tokens=num_tokens,
    )


def take_grads(ref: GradRef) -> GradBuffer:
    """The buffer behind an in-process GradRef (removed from the registry)."""
    ref_id = ref.uri.removeprefix("memory://grads/")
    with _lock:
        grads = _grads.pop(ref_id, None)
    if grads is None:
        raise LookupError(
            f"gradient {ref.uri} is not in this process (it was computed by a process that ended); "
            "rerun the step's backward tasks"
        )
    return grads


_seconds: dict[str, dict[str, float]] = {}


def add_seconds(run_id: str, stage: str, seconds: float) -> None:
    with _lock:
        stages = _seconds.setdefault(run_id, {})
        stages[stage] = stages.get(stage, 0.0) + seconds


@contextlib.contextmanager
def timed(run_id: str, stage: str) -> Iterator[None]:
    """Add the block's wall-clock seconds to `stage` of the run's current step."""
    started = time.perf_counter()
    try:
        yield
    finally:
        add_seconds(run_id, stage, time.perf_counter() - started)


def take_seconds(run_id: str) -> dict[str, float]:
    """Per-stage seconds accumulated since the last call (one step's worth)."""
    with _lock:
        return _seconds.pop(run_id, {})


def add_listener(listener: Callable[[str, dict], None]) -> None:
    """Progress callbacks (the CLI's progress bars): listener(event, fields)."""
    _listeners.append(listener)


def remove_listener(listener: Callable[[str, dict], None]) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def emit(event: str, **fields) -> None:
    for listener in list(_listeners):
        listener(event, fields)
