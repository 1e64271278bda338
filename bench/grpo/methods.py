"""One step of each benchmarked method, run inside the current process (the worker's).

Legend: P prompt tokens, G responses, R_i response tokens, V vocabulary.

- `longstraw_step`: `accumulate_group_gradients` from prompt ids (prefill included), exact or
  detached prompt gradient.
- `full_sequence_step`: what TRL, verl and OpenRLHF do without sequence parallelism: each
  prompt+response sequence through the transformers model with autograd and gradient
  checkpointing, log-probs of the completion tokens only (`logits_to_keep`, as TRL's
  `_get_per_token_logps_and_entropies`), the group's GRPO loss, backward. Micro-batch 1 (gradient
  accumulation over the group), the most memory-frugal way to run it; `measured_sequences` of
  the G sequences are run and the time is scaled linearly to G.
- `trl_step`: TRL 1.16's own `GRPOTrainer._compute_loss` on the same batch, one sequence at a
  time (optional): checks that `full_sequence_step` computes TRL's loss; it is not a TRL
  training step (`bench/bench_trl_step.py` runs one: `GRPOTrainer.train()`, all G rows at once,
  its own generation).
- `prefill_step` / `hf_forward_step`: the prompt alone, LongStraw's sharded no-grad prefill against
  transformers' plain forward at its best settings (no grad, sdpa, `logits_to_keep=1`, no cache).
- `rollout_step` / `trl_generate_step`: sampling G completions of exactly `response_tokens`
  tokens from one prompt: LongStraw's prefill + `sample_responses` (one state, G rows decoded in
  one batch) against TRL 1.16's own generation (`GRPOTrainer._generate_single_turn`: G prompt
  copies through transformers' `generate`, gradient checkpointing on in training as TRL runs it):
  TRL's generation function alone, not its training step.
- `decode_steps`: the time of one decoding step for each G of `decode_group_sizes` from one
  prefilled state.
- `naive_group_gradient`: the reference gradient, full-sequence autograd over the whole group
  without checkpointing, TRL's batched loss (`group_loss`).
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import PreTrainedModel

from bench.grpo.workload import Batch, BenchSpec
from longstraw.engine.group import accumulate_group_gradients
from longstraw.engine.prefill import prefill
from longstraw.engine.rollout import SamplingParams, sample_responses
from longstraw.grpo.losses import branch_loss, group_loss, sequence_weights
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig

# TRL's defaults (loss_type "dapo", beta 0, epsilon 0.2): what a user gets without tuning.
LOSS_CONFIG = GRPOConfig()


def kv_fp32_bytes(model: PreTrainedModel, prompt_tokens: int) -> int:
    """fp32 bytes of the K/V part of the prompt state (the size of exact mode's cotangent dS)."""
    from longstraw.models.adapters import state_spec

    fa = state_spec(model).full_attention
    if fa is None:
        return 0
    per_token = len(fa.layer_indices) * fa.num_kv_heads * (fa.head_dim + fa.value_head_dim)
    return per_token * (prompt_tokens - 1) * 4


def longstraw_step(model: PreTrainedModel, spec: BenchSpec, batch: Batch, mode: str) -> dict:
    started = time.perf_counter()
    stats = accumulate_group_gradients(
        model,
        batch.prompt_ids,
        batch.responses,
        batch.advantages,
        LOSS_CONFIG,
        EngineConfig(shard_tokens=spec.shard_tokens, prompt_grad=mode),
    )
    seconds = time.perf_counter() - started
    return {
        "step_s": seconds,
        "stages_s": stats.seconds.model_dump(),
        "loss": stats.loss,
        "state_bytes": stats.state_bytes,
        "checkpoint_bytes": stats.checkpoint_bytes,
        "cotangent_bytes": stats.cotangent_bytes,
    }


def completion_logprobs(
    model: PreTrainedModel, prompt_ids: torch.Tensor, response_ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """[R] fp32 log-probs of the response tokens from one prompt+response forward (TRL's way)."""
    num = response_ids.numel()
    input_ids = torch.cat([prompt_ids, response_ids]).unsqueeze(0).to(model.device)
    # TRL keeps num+1 logits and drops the last: position t predicts token t+1.
    logits = model(input_ids=input_ids, logits_to_keep=num + 1, use_cache=False).logits
    logits = logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, response_ids.view(1, -1, 1).to(logp.device)).view(num)


def full_sequence_step(model: PreTrainedModel, spec: BenchSpec, batch: Batch) -> dict:
    model.gradient_checkpointing_enable()
    # Checkpointing only recomputes in training mode; the model has no dropout.
    model.train()
    lengths = [r.numel() for r in batch.responses]
    weights = sequence_weights(LOSS_CONFIG.loss_type, lengths, LOSS_CONFIG)
    measured = min(spec.measured_sequences, spec.group_size)
    loss_total = 0.0
    started = time.perf_counter()
    for i in range(measured):
        logp = completion_logprobs(
            model, batch.prompt_ids, batch.responses[i], LOSS_CONFIG.temperature
        )
        loss, _ = branch_loss(logp, None, float(batch.advantages[i]), weights[i], LOSS_CONFIG)
        loss.backward()
        loss_total += float(loss.detach())
        del logp, loss
    seconds = time.perf_counter() - started
    return {
        "measured_s": seconds,
        "measured_sequences": measured,
        # Scaled linearly to the group: each sequence costs the same up to +-5 response tokens.
        "step_s": seconds * spec.group_size / measured,
        "step_s_scaled": measured < spec.group_size,
        "loss_measured_sequences": loss_total,
    }


def _trl_trainer(
    model: PreTrainedModel,
    spec: BenchSpec,
    batch: Batch,
    work_dir: str,
    *,
    max_completion_length: int | None = None,
    generation_kwargs: dict | None = None,
):
    """A real TRL 1.16 GRPOTrainer around `model` (its `_compute_loss`, or its generation)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    args = TRLConfig(
        output_dir=work_dir,
        per_device_train_batch_size=spec.group_size,
        num_generations=spec.group_size,
        max_completion_length=max_completion_length or max(r.numel() for r in batch.responses),
        generation_kwargs=generation_kwargs,
        loss_type=LOSS_CONFIG.loss_type,
        beta=LOSS_CONFIG.beta,
        epsilon=LOSS_CONFIG.epsilon,
        gradient_checkpointing=True,
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_strategy="no",
        save_strategy="no",
    )
    dataset = Dataset.from_dict({"prompt": ["x"] * spec.group_size})
    tokenizer = AutoTokenizer.from_pretrained(spec.checkpoint)
    return GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )


def trl_inputs(spec: BenchSpec, batch: Batch, indices: list[int]) -> dict:
    """TRL's `_compute_loss` inputs for the sequences `indices` of the batch (right-padded)."""
    num = max(batch.responses[i].numel() for i in indices)
    completion = torch.zeros(len(indices), num, dtype=torch.long)
    mask = torch.zeros(len(indices), num, dtype=torch.long)
    for row, i in enumerate(indices):
        completion[row, : batch.responses[i].numel()] = batch.responses[i]
        mask[row, : batch.responses[i].numel()] = 1
    prompt = batch.prompt_ids.unsqueeze(0).expand(len(indices), -1)
    return {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": completion,
        "completion_mask": mask,
        "advantages": batch.advantages[indices],
        # dapo: tokens of the whole group, as TRL counts them over the generation batch.
        "num_items_in_batch": torch.tensor(float(sum(r.numel() for r in batch.responses))),
    }


def trl_step(model: PreTrainedModel, spec: BenchSpec, batch: Batch, work_dir: str) -> dict:
    """TRL's loss function (`_compute_loss`) on micro-batches of one sequence, `measured_sequences`
    of them, the time scaled to G: what a step's loss and backward cost sequence by sequence, not
    a TRL training step (no generation, no optimizer, not TRL's batching)."""
    trainer = _trl_trainer(model, spec, batch, work_dir)
    model.gradient_checkpointing_enable()
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    measured = min(spec.measured_sequences, spec.group_size)
    loss_total = 0.0
    started = time.perf_counter()
    for i in range(measured):
        loss = trainer._compute_loss(model, trl_inputs(spec, batch, [i]))
        loss.backward()
        loss_total += float(loss.detach())
    seconds = time.perf_counter() - started
    return {
        "measured_s": seconds,
        "measured_sequences": measured,
        "step_s": seconds * spec.group_size / measured,
        "step_s_scaled": measured < spec.group_size,
        "loss_measured_sequences": loss_total,
    }


def prefill_step(model: PreTrainedModel, spec: BenchSpec, batch: Batch) -> dict:
    started = time.perf_counter()
    state = prefill(model, batch.prompt_ids, shard_tokens=spec.shard_tokens)
    seconds = time.perf_counter() - started
    return {
        "step_s": seconds,
        "tokens_per_s": state.num_tokens / seconds,
        "state_bytes": state.state_bytes(),
        "checkpoint_bytes": state.checkpoint_bytes(),
    }


def hf_forward_step(model: PreTrainedModel, spec: BenchSpec, batch: Batch) -> dict:
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    input_ids = batch.prompt_ids[:-1].unsqueeze(0).to(model.device)
    started = time.perf_counter()
    with torch.no_grad():
        model(input_ids=input_ids, logits_to_keep=1, use_cache=False)
    seconds = time.perf_counter() - started
    return {"step_s": seconds, "tokens_per_s": input_ids.shape[1] / seconds}


def _exact_length_params(group_size: int, tokens: int) -> SamplingParams:
    # No stop tokens: every row decodes exactly `tokens` tokens (TRL gets min_new_tokens).
    return SamplingParams(num_samples=group_size, max_new_tokens=tokens)


def rollout_step(model: PreTrainedModel, spec: BenchSpec, batch: Batch) -> dict:
    """Prefill once, then sample G completions of exactly `response_tokens` tokens in one batch."""
    started = time.perf_counter()
    state = prefill(model, batch.prompt_ids, shard_tokens=spec.shard_tokens)
    prefilled = time.perf_counter()
    params = _exact_length_params(spec.group_size, spec.response_tokens)
    responses = sample_responses(
        model, state, params, generator=torch.Generator().manual_seed(spec.seed)
    )
    done = time.perf_counter()
    assert all(len(r.token_ids) == spec.response_tokens for r in responses)
    return {
        "step_s": done - started,
        "prefill_s": prefilled - started,
        "sampling_s": done - prefilled,
        "decode_step_s": (done - prefilled) / spec.response_tokens,
    }


def trl_generate_step(model: PreTrainedModel, spec: BenchSpec, batch: Batch, work_dir: str) -> dict:
    """TRL 1.16's generation for one GRPO group: G copies of the prompt through `generate`."""
    trainer = _trl_trainer(
        model,
        spec,
        batch,
        work_dir,
        max_completion_length=spec.response_tokens,
        generation_kwargs={"min_new_tokens": spec.response_tokens},
    )
    # As in TRL's training loop: the model trains with gradient checkpointing, which TRL's
    # generation context turns off for the call.
    model.gradient_checkpointing_enable()
    model.train()
    prompts = [batch.prompt_ids.tolist()] * spec.group_size
    started = time.perf_counter()
    with torch.no_grad():
        completions, _ = trainer._generate_single_turn(prompts, None, {}, spec.group_size)
    seconds = time.perf_counter() - started
    model.gradient_checkpointing_disable()
    model.eval()
    assert [len(c) for c in completions] == [spec.response_tokens] * spec.group_size
    return {"step_s": seconds, "decode_step_s": None}


def _timed_decodes(model, state, group_size: int, spec: BenchSpec, repeat: int) -> float:
    generator = torch.Generator().manual_seed(spec.seed + repeat)
    params = _exact_length_params(group_size, spec.response_tokens)
    started = time.perf_counter()
    sample_responses(model, state, params, generator=generator)
    return (time.perf_counter() - started) / spec.response_tokens


def decode_steps(model: PreTrainedModel, spec: BenchSpec, batch: Batch) -> dict:
    """One prefill, then for each G: a short warm-up and `decode_repeats` timed decodes of
    `response_tokens` steps; a step's time is the median decode's time / `response_tokens`.

    With `decode_reference_tokens`, the state of the prompt's first that many tokens is decoded
    from too, alternating with the full state decode by decode (its order reversed every
    repeat), so their ratio is measured under the same load.
    """
    started = time.perf_counter()
    states = {"full": prefill(model, batch.prompt_ids, shard_tokens=spec.shard_tokens)}
    prefill_s = time.perf_counter() - started
    reference = spec.decode_reference_tokens
    if 0 < reference < spec.prompt_tokens:
        states["reference"] = prefill(
            model, batch.prompt_ids[:reference], shard_tokens=spec.shard_tokens
        )
    runs: dict[str, dict[int, list[float]]] = {name: {} for name in states}
    for group_size in spec.decode_group_sizes or (spec.group_size,):
        for name, state in states.items():
            sample_responses(model, state, _exact_length_params(group_size, 2))
            runs[name][group_size] = []
        for repeat in range(spec.decode_repeats):
            order = list(states) if repeat % 2 == 0 else list(reversed(states))
            for name in order:
                step = _timed_decodes(model, states[name], group_size, spec, repeat)
                runs[name][group_size].append(step)
    median = {
        name: {g: statistics.median(r) for g, r in by_g.items()} for name, by_g in runs.items()
    }
    result = {
        "step_s": prefill_s + sum(sum(r) for r in runs["full"].values()) * spec.response_tokens,
        "prefill_s": prefill_s,
        "decode_step_s": median["full"],
        "decode_step_runs_s": runs["full"],
    }
    if "reference" in states:
        result.update(
            reference_tokens=reference,
            reference_decode_step_s=median["reference"],
            reference_decode_step_runs_s=runs["reference"],
            ratio_to_reference={
                g: median["full"][g] / median["reference"][g] for g in runs["full"]
            },
        )
    return result


def flat_grad(model: PreTrainedModel) -> torch.Tensor:
    """[N] fp32 gradient of every trainable parameter (zeros where none), then cleared."""
    parts = []
    for p in model.parameters():
        if p.requires_grad:
            g = torch.zeros(p.numel()) if p.grad is None else p.grad.detach().float().flatten()
            parts.append(g.cpu())
            p.grad = None
    return torch.cat(parts)


def naive_group_gradient(
    model: PreTrainedModel, batch: Batch, loss_config: GRPOConfig = LOSS_CONFIG
) -> tuple[torch.Tensor, float]:
    """The exact full-sequence gradient: every sequence's graph at once, TRL's batched loss
    (`loss_config`: TRL's defaults unless a caller's run uses other settings)."""
    model.eval()
    logps = [
        completion_logprobs(model, batch.prompt_ids, r, loss_config.temperature)
        for r in batch.responses
    ]
    num = max(r.numel() for r in batch.responses)
    logp_GT = torch.zeros(len(logps), num)
    mask_GT = torch.zeros(len(logps), num)
    for i, lp in enumerate(logps):
        logp_GT = logp_GT.index_put((torch.tensor([i]), torch.arange(lp.numel())), lp)
        mask_GT[i, : lp.numel()] = 1.0
    loss, _ = group_loss(logp_GT, None, batch.advantages, mask_GT, loss_config)
    loss.backward()
    return flat_grad(model), float(loss.detach())


def compare(grad: torch.Tensor, reference: torch.Tensor) -> dict:
    # float64: an fp32 cosine of 29M-element vectors rounds to values above 1.
    grad, reference = grad.double(), reference.double()
    diff = grad - reference
    return {
        "cosine": float(torch.nn.functional.cosine_similarity(grad, reference, dim=0)),
        "relative_error": float(diff.norm() / reference.norm()),
        "max_abs_diff": float(diff.abs().max()),
    }


def fidelity_step(model: PreTrainedModel, spec: BenchSpec, batch: Batch, work_dir: str) -> dict:
    """Each method's gradient against `naive_group_gradient` on the same (small) batch."""
    reference, ref_loss = naive_group_gradient(model, batch)
    rows = {}
    for mode in ("exact", "detached"):
        model.eval()
        stats = accumulate_group_gradients(
            model,
            batch.prompt_ids,
            batch.responses,
            batch.advantages,
            LOSS_CONFIG,
            EngineConfig(shard_tokens=spec.shard_tokens, prompt_grad=mode),
        )
        rows[f"longstraw-{mode}"] = {**compare(flat_grad(model), reference), "loss": stats.loss}
    full_spec = spec.model_copy(update={"measured_sequences": spec.group_size})
    full = full_sequence_step(model, full_spec, batch)
    rows["full-sequence"] = {
        **compare(flat_grad(model), reference),
        "loss": full["loss_measured_sequences"],
    }
    model.gradient_checkpointing_disable()
    try:
        trl = trl_step(model, full_spec, batch, work_dir)
        rows["trl"] = {
            **compare(flat_grad(model), reference),
            "loss": trl["loss_measured_sequences"],
        }
    except ImportError as error:
        rows["trl"] = {"skipped": f"TRL not importable: {error}"}
    model.zero_grad(set_to_none=True)
    return {"reference_loss": ref_loss, "gradient_numel": reference.numel(), "methods": rows}
