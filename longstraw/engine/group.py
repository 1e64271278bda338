"""One GRPO group's gradient: prefill once, replay each branch with autograd, (exact) sweep.

The live autograd graph is one short branch at a time, so peak memory does not grow with the
group size G. Each branch's share of the loss uses a weight fixed before replay from the whole
group's token counts (`longstraw.grpo.losses.sequence_weights`), so the per-branch gradients sum
to the gradient of the group's loss computed at once.

Gradients are drained after every backward into fp32 accumulators (bf16 models keep fp32
gradients: summing 256 bf16 contributions loses 2.5e-2 relative, fp32 3.8e-7). The function
starts from zeroed accumulators and never adds into a buffer it did not zero, then either adds
its contribution to `param.grad` or into a caller's `GradBuffer` — so a retried call cannot
double-count.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PreTrainedModel

from longstraw.engine.branch_tree import segmented_branch_backward, tree_group_backward
from longstraw.engine.exchange import LOCAL, PrefixExchange
from longstraw.engine.gradient_sink import HoldsGrads, grads_set_aside, trainable_parameters
from longstraw.engine.prefill import prefill
from longstraw.engine.replay import PromptCotangent, replay_branch
from longstraw.engine.state import PrefixState
from longstraw.engine.state_tiers import state_traffic, tiered_for_group
from longstraw.engine.sweep import sweep_prompt_shards
from longstraw.engine.sweep_checkpoint import (
    SweepCheckpoints,
    record_json,
    record_parts,
    sweep_tensors,
    zero_tensors,
)
from longstraw.engine.validation import as_token_tensor, check_positions
from longstraw.grpo.grad_buffer import GradBuffer
from longstraw.grpo.losses import BranchStats, branch_loss, reduce_stats, sequence_weights
from longstraw.models.adapters import state_spec
from longstraw.models.lora import adapter_dropout_training, has_adapter_dropout
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.results import GroupStats, StageSeconds, StateTraffic
from longstraw.schemas.run import EngineConfig

PromptGrad = Literal["exact", "detached"]
PROMPT_GRAD_MODES = ("exact", "detached")


def deterministic_when_exact(prompt_grad: str) -> contextlib.AbstractContextManager[None]:
    """Exact mode runs with deterministic algorithms (the sweep checks recomputation bitwise)."""
    return deterministic_algorithms() if prompt_grad == "exact" else contextlib.nullcontext()


CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"
"""cuBLAS's workspace setting for reproducible results (PyTorch's reproducibility notes): with
deterministic algorithms on, PyTorch refuses cuBLAS calls on CUDA unless
`CUBLAS_WORKSPACE_CONFIG` is `:4096:8` or `:16:8`."""


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    if torch.cuda.is_available():
        # Read by PyTorch at every cuBLAS call it checks; a user's own setting stands.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def _per_branch(values, num: int, what: str) -> list:
    if values is None:
        return [None] * num
    if len(values) != num:
        raise ValueError(
            f"{what} has {len(values)} entries but there are {num} responses; pass one per response"
        )
    return list(values)


def peak_rss_bytes() -> int:
    """Peak resident set of this process so far (bytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class GroupInputs:
    """One group's checked branch inputs, the same at every placement.

    Every list has one entry per response; None where that input was not given.
    """

    response_ids: list[torch.Tensor]
    """[G][R_i] int64 token ids."""
    advantages_G: torch.Tensor
    """[G] fp32."""
    old_logprobs: list[torch.Tensor | None]
    """[G][R_i] log-probs of the rollout policy (None: the current ones, detached)."""
    ref_logprobs: list[torch.Tensor | None]
    """[G][R_i] reference-model log-probs (beta > 0)."""
    loss_masks: list[torch.Tensor | None]
    """[G][R_i] fp32, 1 where a token counts."""
    token_weights: list[torch.Tensor | None]
    """[G][R_i] constant per-token factors (truncated importance weights)."""
    lengths: list[int]
    """[G] tokens that count per response."""
    weights_G: torch.Tensor
    """[G] each branch's loss weight (`sequence_weights`), fixed before replay."""

    def branch_loss(self, i: int, logp_R: torch.Tensor, loss_config: GRPOConfig):
        """Branch i's share of the group loss and its stats (`longstraw.grpo.losses.branch_loss`)."""
        old, ref, weights = self.old_logprobs[i], self.ref_logprobs[i], self.token_weights[i]
        return branch_loss(
            logp_R,
            None if old is None else torch.as_tensor(old, dtype=logp_R.dtype),
            float(self.advantages_G[i]),
            self.weights_G[i],
            loss_config,
            None if ref is None else torch.as_tensor(ref, dtype=logp_R.dtype),
            self.loss_masks[i],
            None if weights is None else torch.as_tensor(weights),
        )


def group_inputs(
    model: PreTrainedModel,
    responses: Sequence[torch.Tensor | Sequence[int]],
    advantages: torch.Tensor | Sequence[float],
    loss_config: GRPOConfig,
    *,
    prompt_grad: str,
    old_logprobs: Sequence[torch.Tensor] | None = None,
    ref_logprobs: Sequence[torch.Tensor] | None = None,
    loss_masks: Sequence[torch.Tensor] | None = None,
    num_items_in_batch: float | None = None,
    num_sequences_in_batch: int | None = None,
    importance_weights: Sequence[torch.Tensor] | None = None,
) -> GroupInputs:
    """Check a group's inputs (each error says what to change) and fix the loss weights."""
    if prompt_grad not in PROMPT_GRAD_MODES:
        raise ValueError(f"prompt_grad must be one of {PROMPT_GRAD_MODES}, got {prompt_grad!r}")
    if not isinstance(loss_config, GRPOConfig):
        raise ValueError(
            f"loss_config must be a longstraw.schemas.GRPOConfig, got {type(loss_config).__name__}"
        )
    num = len(responses)
    if num == 0:
        raise ValueError("responses is empty; a GRPO group needs at least one response")
    vocab = model.config.get_text_config().vocab_size
    response_ids = [
        as_token_tensor(r, what=f"responses[{i}]", vocab_size=vocab)
        for i, r in enumerate(responses)
    ]
    advantages_G = torch.as_tensor(advantages, dtype=torch.float32).flatten()
    if advantages_G.numel() != num:
        raise ValueError(
            f"advantages has {advantages_G.numel()} entries for {num} responses; pass one per response"
        )
    if not torch.isfinite(advantages_G).all():
        raise ValueError(f"advantages must be finite, got {advantages_G.tolist()}")
    olds = _per_branch(old_logprobs, num, "old_logprobs")
    refs = _per_branch(ref_logprobs, num, "ref_logprobs")
    masks = _per_branch(loss_masks, num, "loss_masks")
    token_weights = _per_branch(importance_weights, num, "importance_weights")
    if loss_config.beta != 0.0 and ref_logprobs is None:
        raise ValueError(f"beta={loss_config.beta} needs ref_logprobs; pass them or set beta=0.0")
    per_branch = zip(response_ids, olds, refs, masks, token_weights, strict=True)
    for i, (r, old, ref, mask, iw) in enumerate(per_branch):
        checks = (
            ("old_logprobs", old),
            ("ref_logprobs", ref),
            ("loss_masks", mask),
            ("importance_weights", iw),
        )
        for what, t in checks:
            if t is not None and len(t) != r.numel():
                raise ValueError(
                    f"{what}[{i}] has {len(t)} entries for a {r.numel()}-token response"
                )
    masks = [None if m is None else torch.as_tensor(m, dtype=torch.float32) for m in masks]
    lengths = [
        int(r.numel()) if m is None else int(m.sum())
        for r, m in zip(response_ids, masks, strict=True)
    ]
    weights_G = sequence_weights(
        loss_config.loss_type,
        lengths,
        loss_config,
        num_items_in_batch=num_items_in_batch,
        num_sequences_in_batch=num_sequences_in_batch,
    )
    return GroupInputs(
        response_ids, advantages_G, olds, refs, masks, token_weights, lengths, weights_G
    )


def accumulate_group_gradients(
    model: PreTrainedModel,
    prompt: PrefixState | torch.Tensor | Sequence[int],
    responses: Sequence[torch.Tensor | Sequence[int]],
    advantages: torch.Tensor | Sequence[float],
    loss_config: GRPOConfig,
    engine: EngineConfig | None = None,
    *,
    old_logprobs: Sequence[torch.Tensor] | None = None,
    ref_logprobs: Sequence[torch.Tensor] | None = None,
    loss_masks: Sequence[torch.Tensor] | None = None,
    importance_weights: Sequence[torch.Tensor] | None = None,
    num_items_in_batch: float | None = None,
    num_sequences_in_batch: int | None = None,
    grad_buffer: GradBuffer | None = None,
) -> GroupStats:
    """Accumulate one group's GRPO gradient, replaying one branch at a time.

    `prompt` is prompt ids or the `PrefixState` rollout already computed (never prefill twice).
    `responses` [G] token ids; `advantages` [G]; `old_logprobs` / `ref_logprobs` [G][R_i]
    (old defaults to the current log-probs, detached, as TRL does with one update per rollout;
    ref is required when beta != 0); `loss_masks` [G][R_i] 1 where a token counts (0 on tool
    output inside a response). The normaliser comes from `num_items_in_batch` /
    `num_sequences_in_batch` (default: this group) and is applied once. `importance_weights`
    [G][R_i] are constant per-token factors (TRL's truncated importance sampling of responses
    generated by another engine, `longstraw.grpo.losses.importance_weights`).

    The contribution is added to `param.grad` (fp32 models) or, if given, to `grad_buffer`.
    `engine` (the run config's `engine` section; None: its defaults) says how:
    `prompt_grad="exact"` adds the gradient through the prompt state (reverse sweep),
    `"detached"` treats the state as a constant, the capacity mode of the original system;
    `shard_tokens` splits the prefill of prompt ids (a `PrefixState` keeps its own shards);
    a response longer than `branch_segment_tokens` is replayed in segments of that many tokens
    (`longstraw.engine.segmented_replay`); `share_response_prefixes` runs the part responses
    share once (a prefix tree, `longstraw.engine.branch_tree`; gradients unchanged);
    `state_budget_bytes` streams the state and its cotangent from `state_tier` chunk by chunk
    (`longstraw.engine.state_tiers`).
    """
    if engine is None:
        engine = EngineConfig()
    if not isinstance(engine, EngineConfig):
        raise ValueError(
            f"engine must be a longstraw.EngineConfig (the run config's engine section) or None, "
            f"got {type(engine).__name__}"
        )
    inputs = group_inputs(
        model,
        responses,
        advantages,
        loss_config,
        prompt_grad=engine.prompt_grad,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        loss_masks=loss_masks,
        num_items_in_batch=num_items_in_batch,
        num_sequences_in_batch=num_sequences_in_batch,
        importance_weights=importance_weights,
    )
    # Before any prefill: a response that cannot fit must not cost a prompt's worth of compute.
    prompt_len = (
        prompt.prompt_len if isinstance(prompt, PrefixState) else torch.as_tensor(prompt).numel()
    )
    check_positions(
        state_spec(model),
        prompt_len + max(r.numel() for r in inputs.response_ids),
        what="prompt + longest response",
    )
    prefill_seconds = 0.0
    if isinstance(prompt, PrefixState):
        state = prompt
    else:
        started = time.perf_counter()
        state = prefill(model, prompt, shard_tokens=engine.shard_tokens)
        prefill_seconds = time.perf_counter() - started

    accumulator, stats = group_gradient(model, state, inputs, loss_config, engine)
    if grad_buffer is None:
        accumulator.into_param_grads(model)
    else:
        grad_buffer.add_(accumulator)
    seconds = stats.seconds.model_copy(update={"prefill": prefill_seconds})
    return stats.model_copy(update={"seconds": seconds})


def group_gradient(
    model: PreTrainedModel,
    state: PrefixState,
    inputs: GroupInputs,
    loss_config: GRPOConfig,
    engine: EngineConfig,
    *,
    exchange: PrefixExchange = LOCAL,
    checkpoints: SweepCheckpoints | None = None,
    on_sweep_shard: Callable[[int, int, int], None] | None = None,
) -> tuple[HoldsGrads, GroupStats]:
    """One group's gradient at any world size: (the accumulator of this process's part of it —
    `.grads` [name] fp32, whole on one process, this rank's rows on ranks, see
    `GradientSink.accumulator` —, the group's statistics).

    `state` is the whole prompt state or this rank's part; `exchange` (`engine.exchange`) the
    placement's (on ranks: this rank's rows, laid out for the replicas they are summed over).
    Under `engine.state_budget_bytes` the state (each rank's part) and its cotangent stream from
    `engine.state_tier`. The figures a memory limit must cover (peak RSS, the cotangent's bytes,
    the tiered state's traffic) are the busiest rank's. `.grad` is left untouched.
    `checkpoints` and `on_sweep_shard` as in `replay_and_sweep`.
    """
    sink = exchange.gradient_sink(model)
    exact = engine.prompt_grad == "exact"
    with tiered_for_group(
        model, state, engine.state_budget_bytes, engine.state_tier, engine.state_dir, exact
    ) as state:
        record = replay_and_sweep(
            model, state, inputs, loss_config, engine.prompt_grad,
            replay_sink=sink.replay, sweep_sink=sink.sweep, exchange=exchange,
            segment_tokens=engine.branch_segment_tokens,
            share_prefixes=engine.share_response_prefixes,
            on_gradient_slices=sink.on_gradient_slices,
            checkpoints=checkpoints, accumulator=sink.accumulator,
            on_sweep_shard=on_sweep_shard,
        )  # fmt: skip
        traffic = state_traffic(state)
        figures = [peak_rss_bytes(), record.cotangent_bytes]
        if traffic is not None:
            figures += [traffic.peak_resident_bytes, traffic.bytes_read, traffic.bytes_written]
        peak, cotangent_bytes, *tiered = exchange.collectives.busiest(figures)
        stats = group_stats(
            engine.prompt_grad,
            state,
            record.losses,
            [logp.cpu().tolist() for logp in record.logprobs],
            inputs.lengths,
            record.stats,
            {"replay": record.seconds["replay"], "sweep": record.seconds.get("sweep", 0.0)},
            cotangent_bytes=cotangent_bytes,
            device=model.device,
            peak_rss=peak,
        ).model_copy(
            update={
                "sweep_shards_computed": record.sweep_shards_computed,
                "sweep_shards_resumed": record.sweep_shards_resumed,
            }
        )
    if tiered:
        busiest = StateTraffic(
            peak_resident_bytes=tiered[0], bytes_read=tiered[1], bytes_written=tiered[2]
        )
        stats = stats.model_copy(update={"state_traffic": busiest})
    return sink.accumulator, stats


@dataclass
class ReplayRecord:
    """What replaying a group's branches produced besides gradients."""

    logprobs: list[torch.Tensor] = field(default_factory=list)
    """[G][R_i] detached fp32 log-probs."""
    losses: list[float] = field(default_factory=list)
    """[G] each branch's share of the loss."""
    stats: list[BranchStats] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall-clock seconds of "replay" and (exact mode, timed by the caller) "sweep"."""
    cotangent_bytes: int = 0
    """Bytes of the fp32 prompt cotangent dS this process held (a rank: its slice)."""
    sweep_shards_computed: int = 0
    """Shards the exact sweep recomputed here."""
    sweep_shards_resumed: int = 0
    """Shards it took from a sweep checkpoint (swept by an earlier attempt)."""

    def add(self, logp: torch.Tensor, loss: torch.Tensor, stats: BranchStats) -> None:
        self.logprobs.append(logp.detach())
        self.losses.append(float(loss.detach()))
        self.stats.append(stats)


def replay_group_branches(
    model: PreTrainedModel,
    state,
    inputs: GroupInputs,
    loss_config: GRPOConfig,
    cotangent: PromptCotangent | None,
    *,
    segment_tokens: int | None,
    share_prefixes: bool,
    exchange: PrefixExchange = LOCAL,
) -> ReplayRecord:
    """Replay every branch of the group and backpropagate its loss, in response order.

    `state` is the whole prompt state or this rank's slice of it; `exchange` (`engine.exchange`)
    reads the rest of the prefix (on ranks every rank calls this with the same arguments: the
    replay is replicated). With `share_prefixes` the responses run as a prefix tree
    (`engine.branch_tree`); a response longer than `segment_tokens` runs in segments
    (`engine.segmented_replay`); any other as one graph. With `cotangent` (exact mode) the
    cotangent of the prompt state the branches read is added into it. Parameter gradients
    accumulate as `loss.backward()` leaves them; the caller decides where (hooks).
    """
    record = ReplayRecord()
    started = time.perf_counter()
    temperature = loss_config.temperature
    if share_prefixes:
        for logp, loss, stats in tree_group_backward(
            model,
            state,
            inputs.response_ids,
            lambda i, logp: inputs.branch_loss(i, logp, loss_config),
            segment_tokens=segment_tokens,
            temperature=temperature,
            cotangent=cotangent,
            exchange=exchange,
        ):
            record.add(logp, loss, stats)
        record.seconds["replay"] = time.perf_counter() - started
        return record
    for i, response in enumerate(inputs.response_ids):
        if segment_tokens is not None and response.numel() > segment_tokens:
            logp, loss, stats = segmented_branch_backward(
                model,
                state,
                response,
                functools.partial(inputs.branch_loss, i, loss_config=loss_config),
                segment_tokens=segment_tokens,
                temperature=temperature,
                cotangent=cotangent,
                exchange=exchange,
            )
            record.add(logp, loss, stats)
            continue
        logp, branch = replay_branch(
            model, state, response, temperature=temperature, cotangent=cotangent,
            exchange=exchange,
        )  # fmt: skip
        loss, stats = inputs.branch_loss(i, logp, loss_config)
        loss.backward()
        if cotangent is not None:
            branch.add_leaf_grads_into(cotangent)
        record.add(logp, loss, stats)
        del logp, loss, branch
    record.seconds["replay"] = time.perf_counter() - started
    return record


def replay_and_sweep(
    model: PreTrainedModel,
    state,
    inputs: GroupInputs,
    loss_config: GRPOConfig,
    prompt_grad: str,
    *,
    replay_sink: contextlib.AbstractContextManager,
    sweep_sink: contextlib.AbstractContextManager | None = None,
    exchange: PrefixExchange = LOCAL,
    segment_tokens: int | None = None,
    share_prefixes: bool = False,
    after_shard: Callable[[int], None] | None = None,
    on_gradient_slices: Callable[[int, int], None] | None = None,
    checkpoints: SweepCheckpoints | None = None,
    accumulator: HoldsGrads | None = None,
    on_sweep_shard: Callable[[int, int, int], None] | None = None,
) -> ReplayRecord:
    """One group's gradient work at any world size: replay every branch (`replay_group_branches`)
    and, in exact mode, sweep the prompt-state cotangent back through the prefill shards
    (`engine.sweep`), with the caller's `.grad` set aside.

    Branch gradients go where `replay_sink` takes them as autograd accumulates them, the sweep's
    where `sweep_sink` does (None: they stay in `.grad` for `after_shard(shard)` to collect);
    `on_gradient_slices` is the sweep's (ranks). The record times replay and sweep apart and
    holds the bytes of this process's cotangent dS.

    With `checkpoints` (exact mode; `accumulator` the one both sinks add into) the sweep commits
    its progress when they say it is due, and a latest checkpoint of this backward replaces
    replay and the shards it covers (`engine.sweep_checkpoint`): the same gradient, bitwise.
    `on_sweep_shard(done, total, resumed)` is told the shards swept, at the sweep's start and
    after each shard.
    """
    params = trainable_parameters(model)
    cotangent = PromptCotangent.zeros_like_state(state) if prompt_grad == "exact" else None
    dropout = adapter_dropout_in_replay(
        model, prompt_grad, inputs.response_ids, segment_tokens, share_prefixes
    )
    with grads_set_aside(params), deterministic_when_exact(prompt_grad):
        resumed = None
        if cotangent is not None and checkpoints is not None:
            resumed = resumed_sweep(state, cotangent, accumulator, checkpoints)
        if resumed is None:
            swept = 0
            with replay_sink, dropout:
                record = replay_group_branches(
                    model, state, inputs, loss_config, cotangent, segment_tokens=segment_tokens,
                    share_prefixes=share_prefixes, exchange=exchange,
                )  # fmt: skip
        else:
            record, swept = resumed
        if cotangent is not None:
            started = time.perf_counter()
            total = state.num_shards

            def shard_done(shard: int) -> None:
                done = total - shard
                if on_sweep_shard is not None:
                    on_sweep_shard(done, total, swept)
                if checkpoints is not None and shard > 0 and checkpoints.due(done):
                    tensors = sweep_tensors(state, cotangent, accumulator, shard - 1)
                    checkpoints.save(done, tensors, record_json(record))

            if on_sweep_shard is not None:
                on_sweep_shard(swept, total, swept)
            with sweep_sink or contextlib.nullcontext():
                sweep_prompt_shards(
                    model, state, cotangent, exchange=exchange, swept=swept,
                    after_shard=after_shard, on_shard_done=shard_done,
                    on_gradient_slices=on_gradient_slices,
                )  # fmt: skip
            record.seconds["sweep"] = time.perf_counter() - started
            record.cotangent_bytes = cotangent.nbytes()
            record.sweep_shards_computed, record.sweep_shards_resumed = total - swept, swept
    return record


def resumed_sweep(
    state, cotangent: PromptCotangent, accumulator: HoldsGrads, checkpoints: SweepCheckpoints
) -> tuple[ReplayRecord, int] | None:
    """(the replay's record, shards swept) from the latest sweep checkpoint of this backward,
    its tensors put into `cotangent` and `accumulator` (zeroed: as a fresh backward starts);
    None where there is none that matches and reads back whole (the sweep starts over)."""
    found = checkpoints.latest()
    if found is None:
        return None
    assert 0 < found.swept < state.num_shards, found.swept
    tensors = sweep_tensors(state, cotangent, accumulator, state.num_shards - 1 - found.swept)
    if not found.read_into(tensors):
        zero_tensors(tensors)
        return None
    logprobs, losses, stats = record_parts(found.record)
    # This attempt replayed nothing: its replay took no time.
    record = ReplayRecord(logprobs, losses, stats, seconds={"replay": 0.0})
    return record, found.swept


def adapter_dropout_in_replay(
    model: PreTrainedModel,
    prompt_grad: str,
    response_ids: Sequence[torch.Tensor],
    segment_tokens: int | None,
    share_prefixes: bool,
) -> contextlib.AbstractContextManager[None]:
    """The adapters' dropout (LoRA's `lora_dropout`) for the differentiated branch forwards:
    masks drawn there, as a training forward draws them (`models.lora.adapter_dropout_training`;
    nothing for a model without it). Only where that forward is the one differentiated: the
    reverse sweep, segments and a prefix tree recompute forwards and check them bitwise against
    the first pass, which a new mask breaks — refused there."""
    if not has_adapter_dropout(model):
        return contextlib.nullcontext()
    recomputed = None
    if prompt_grad == "exact":
        recomputed = "prompt_grad exact (the reverse sweep recomputes every prefill shard)"
    elif share_prefixes:
        recomputed = "share_response_prefixes (the prefix tree recomputes shared turns)"
    elif segment_tokens is not None and any(r.numel() > segment_tokens for r in response_ids):
        recomputed = f"branch_segment_tokens {segment_tokens} (segments are recomputed)"
    if recomputed is not None:
        raise ValueError(
            f"the model's LoRA adapters have dropout, which {recomputed} cannot reproduce bit for "
            "bit — set lora_dropout to 0, or train detached without segments or shared prefixes"
        )
    return adapter_dropout_training(model)


def group_stats(
    prompt_grad: str,
    state,
    branch_losses: list[float],
    branch_logprobs: list[list[float]],
    num_tokens: list[int],
    branch_stats: list,
    seconds: dict[str, float],
    *,
    cotangent_bytes: int,
    device: torch.device,
    peak_rss: int | None = None,
) -> GroupStats:
    """The statistics of one group's replay (`state` a whole state or a rank's slice; the peak
    RSS this process's unless given)."""
    summary = reduce_stats(branch_stats)
    peak_device = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return GroupStats(
        prompt_grad=prompt_grad,
        loss=sum(branch_losses),
        branch_losses=branch_losses,
        branch_logprobs=branch_logprobs,
        num_tokens=num_tokens,
        prompt_tokens=state.prompt_len,
        num_shards=state.num_shards,
        kl=summary.kl,
        clip_ratio_low=summary.clip_ratio_low,
        clip_ratio_high=summary.clip_ratio_high,
        clip_ratio_region=summary.clip_ratio_region,
        seconds=StageSeconds(**seconds),
        peak_rss_bytes=peak_rss_bytes() if peak_rss is None else peak_rss,
        peak_device_bytes=peak_device,
        state_bytes=state.state_bytes(),
        checkpoint_bytes=state.checkpoint_bytes(),
        cotangent_bytes=cotangent_bytes,
        state_traffic=state_traffic(state),
    )
