"""What this process holds behind the refs stages pass: policies and prompt states.

Everything here is a cache. A stage asks for the object a ref names; on a miss (a fresh process,
a retried task on another worker, a rank that restarted) it is rebuilt from storage: a policy from
its checkpoint and the updates since, a prompt state from the committed Zarr state or its shard
manifests (prefill resumes after the last recorded shard). So a stage gives the same result in
any process from the same refs.

With `parallel.world_size > 1` each rank holds its own part of every prompt state (a
`PrefixState` whose placement names the rank) and its shard of the policy
(`distributed.sharded_policy`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from longstraw.distributed.stage_group import active_group
from longstraw.distributed.topology import Topology
from longstraw.engine.exchange import LOCAL, PrefixExchange
from longstraw.engine.state import PrefixState
from longstraw.engine.state_tiers import StateBudget
from longstraw.schemas.refs import PolicyRef, PromptRef
from longstraw.schemas.run import RunConfig
from longstraw.schemas.storage import StateKey
from longstraw.training.context import RunContext, load_policy
from longstraw.training.persisted_prefill import PrefillSession
from longstraw.training.prompts import PromptExample

_lock = threading.RLock()
_policies: dict[str, RunContext] = {}
_sessions: dict[tuple, PrefillSession] = {}
"""Prefill sessions by (run, version, weights digest, prompt digest): this process's placement's
(`new_session`)."""


def policy(config: RunConfig, ref: PolicyRef) -> RunContext:
    """The run's policy at `ref`'s version, loaded (or rebuilt) on a miss."""
    with _lock:
        ctx = _policies.get(config.run_id)
        if (
            ctx is not None
            and ctx.config == config
            and (ctx.policy_version, ctx.weights_digest) == (ref.policy_version, ref.weights_digest)
        ):
            ctx.step = ref.step
            return ctx
        forget_run(config.run_id)
        ctx = load_policy(config, ref)
        _policies[config.run_id] = ctx
        return ctx


def forget_run(run_id: str) -> None:
    """Drop what this process holds of a run (as a fresh process starts)."""
    with _lock:
        _policies.pop(run_id, None)
        for key in [k for k in _sessions if k[0] == run_id]:
            _sessions.pop(key).discard()


def drop_states_before(run_id: str, policy_version: int) -> None:
    """Free prompt states of older policy versions (invalid for the new weights)."""
    with _lock:
        for key in [k for k in _sessions if k[0] == run_id and k[1] < policy_version]:
            _sessions.pop(key).discard()


def state_key(ctx: RunContext, example: PromptExample) -> StateKey:
    """Storage key of `example`'s state under the run's current weights."""
    return StateKey.policy(
        ctx.config.run_id, ctx.policy_version, ctx.weights_digest, example.digest
    )


def check_prompt(ctx: RunContext, prompt: PromptRef) -> PromptExample:
    """The example `prompt` names, refused when it was planned for other weights."""
    if (prompt.policy_version, prompt.weights_digest) != (ctx.policy_version, ctx.weights_digest):
        raise ValueError(
            f"prompt {prompt.prompt_id} was planned at policy version {prompt.policy_version}, "
            f"the run is at version {ctx.policy_version}: plan the step again"
        )
    example = ctx.source(prompt.index)
    if example.digest != prompt.prompt_digest:
        raise ValueError(
            f"prompt {prompt.index} of the data source has digest {example.digest[:12]}, the ref "
            f"says {prompt.prompt_digest[:12]}: the data changed since the step was planned"
        )
    return example


def new_session(config: RunConfig, model: PreTrainedModel, prompt_ids, **options):
    """A prefill session of this process's part of the prompt state (`PrefillSession` over
    `prefix_exchange()`: the whole state here, or this rank's part, which every rank of the
    stage group holds and calls together); `options` are the session's."""
    return PrefillSession(
        model, prompt_ids, exchange=prefix_exchange(), schedule=config.parallel.schedule,
        **options,
    )  # fmt: skip


def prefill_session(ctx: RunContext, example: PromptExample):
    """The prefill session of `example` at the run's current version (`new_session`), kept
    while the version is current."""
    key = (ctx.config.run_id, ctx.policy_version, ctx.weights_digest, example.digest)
    with _lock:
        found = _sessions.get(key)
        if found is None:
            found = new_session(
                ctx.config,
                ctx.model,
                example.prompt_ids,
                shard_tokens=ctx.config.engine.shard_tokens,
                storage=ctx.config.storage,
                key=state_key(ctx, example),
                budget=StateBudget.of(ctx.config.engine),
            )
            _sessions[key] = found
        return found


def prefix_exchange() -> PrefixExchange:
    """How this process's stages read the prompt prefix: all of it here (one process), or
    across the sequence group this process is a rank of: the stage's replica, or every rank."""
    group = active_group()
    if group is None:
        return LOCAL
    replica = group.scope()
    if replica is None:
        return _cross_rank(None, group.control, None)  # the world: one replica
    # A replica of one rank holds its prompts' states whole, as a single process does.
    if replica.size == 1:
        return LOCAL
    return _cross_rank(replica.sequence, replica.control, group.topology)


def _cross_rank(sequence, control, topology: Topology | None) -> PrefixExchange:
    from longstraw.distributed.exchange import CrossRankExchange

    return CrossRankExchange(group=sequence, control=control, topology=topology)


def prompt_state(ctx: RunContext, example: PromptExample):
    """The prompt state the engine computes on: this process's whole `PrefixState`, or this
    rank's slice of it."""
    state, _ = prefill_session(ctx, example).finish()
    return state


@contextlib.contextmanager
def reference_state(
    ctx: RunContext, example: PromptExample, reference: PreTrainedModel
) -> Iterator[PrefixState]:
    """The reference model's state of `example` for the block: prefilled once per prompt and
    run, by `reference` (what `ctx.reference_policy()` gives, entered by the caller around the
    block).

    Keyed by the reference weights digest only. With persistence on, storage holds it (a committed
    state reads back free in-process); under `engine.state_budget_bytes` it is then tiered from
    its prefill like the policy's (no cotangent: the reference only scores) or streams from its
    committed chunks, and is dropped after the block (its tiers and their hooks on the reference
    model too). With persist_mode off the run context keeps it resident for the run (there is
    no storage to stream it from again); the scoring stage tiers it for its block.
    """
    keep = ctx.config.storage.persist_mode == "off"
    if keep and example.digest in ctx.reference_states:
        yield ctx.reference_states[example.digest]
        return
    budget = None if keep else StateBudget.of(ctx.config.engine)
    options = dict(
        shard_tokens=ctx.config.engine.shard_tokens,
        storage=ctx.config.storage,
        key=StateKey.reference(ctx.reference_digest, example.digest),
        budget=None if budget is None else dataclasses.replace(budget, exact=False),
    )
    session = new_session(ctx.config, reference, example.prompt_ids, **options)
    try:
        state, _ = session.finish()
    except BaseException:
        session.discard()
        raise
    if keep:
        ctx.reference_states[example.digest] = state
        yield state
        return
    try:
        yield state
    finally:
        session.discard()


@contextlib.contextmanager
def eval_state(ctx: RunContext, example: PromptExample) -> Iterator[PrefixState]:
    """The policy's state of a held-out prompt (`training.evaluation`) for the block: prefilled
    for it and discarded after, never persisted (an evaluation reads it once, and the next one
    is at other weights). It is held whole during its prefill; `engine.state_budget_bytes`
    tiers it for the decoding, as the scoring stage does a resident reference state."""
    session = new_session(
        ctx.config,
        ctx.model,
        example.prompt_ids,
        shard_tokens=ctx.config.engine.shard_tokens,
        storage=ctx.config.storage.model_copy(update={"persist_mode": "off"}),
        key=state_key(ctx, example),
    )
    try:
        state, _ = session.finish()
        yield state
    finally:
        session.discard()


def sampling_generator(config: RunConfig, step: int, prompt_index: int) -> torch.Generator:
    """The RNG of one group's rollout: a function of (seed, step, prompt), so any process —
    every rank of a sequence group alike — draws the same responses for the same step."""
    seed = (config.train.seed * 1_000_003 + step * 10_007 + prompt_index) % (2**63)
    return torch.Generator().manual_seed(seed)


def eval_generator(config: RunConfig, step: int, prompt_index: int) -> torch.Generator:
    """The RNG of one held-out prompt's evaluation after `step`: a function of (seed, step,
    prompt) like `sampling_generator`, but drawn apart from it, so an evaluation never repeats
    a training group's draws."""
    digest = hashlib.sha256(f"eval:{config.train.seed}:{step}:{prompt_index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") % (2**63))


def held_policy(run_id: str) -> RunContext | None:
    """The policy of `run_id` this process holds now, if any (progress and tests look at it)."""
    with _lock:
        return _policies.get(run_id)
