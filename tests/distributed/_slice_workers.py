"""Rank functions for the sequence-sharded gradient accumulators (`gradient_slices`).

Each returns plain numbers so the parent process can assert on them.
"""

from __future__ import annotations

import torch
from _workers import _group, data_parallel_reference
from torch.utils._python_dispatch import TorchDispatchMode

# Every fp32 accumulator starts zeroed: these are the ops that allocate one.
_ZERO_FILLED = (
    torch.ops.aten.zeros.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.new_zeros.default,
)


class ZeroFilledBytes(TorchDispatchMode):
    """Bytes of fp32 tensors allocated zero-filled inside the block (accumulators, the prompt
    cotangent, ...): the dense path's two `GradBuffer`s show up as 2 × 4 B × parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ZERO_FILLED and out.dtype == torch.float32:
            self.bytes += out.numel() * out.element_size()
        return out


def _slice_errors(slices, dense) -> dict:
    """This rank's slices vs the same rows of the dense gradient: worst max_diff / max|ref| and
    whether every slice is bitwise equal."""
    worst, bitwise = 0.0, True
    for name, got in slices.grads.items():
        want = slices.rows_of(name, dense.grads[name])
        if got.numel():
            scale = dense.grads[name].abs().max().clamp(min=1e-30)
            worst = max(worst, ((got - want).abs().max() / scale).item())
        bitwise &= torch.equal(got, want)
    return {"max_rel": worst, "bitwise": bitwise}


def slices_against_dense(
    rank: int,
    world: int,
    checkpoint: str,
    prompt_len: int,
    shard_tokens: int,
    dtype: str = "float32",
):
    """Seq-sharded slices vs the dense reference `dense_group_gradients` (both modes), accumulator
    bytes (declared and probed) and the sweep's scatter traffic; `dtype` of the model."""
    from _group_gradients import dense_group_gradients, group_gradient_on_ranks

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.schemas.grpo import GRPOConfig

    model, _, _ = load_checkpoint(checkpoint, dtype=getattr(torch, dtype))
    model.eval()
    prompt, responses, advantages = _group(model.config.get_text_config().vocab_size, prompt_len)
    config = GRPOConfig(beta=0.0)
    state = prefill(model, prompt, shard_tokens=shard_tokens, exchange=CrossRankExchange())
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out: dict = {
        "param_bytes_fp32": 4 * sum(p.numel() for p in params.values()),
        "dim0": {n: p.shape[0] for n, p in params.items()},
    }
    for mode in ("detached", "exact"):
        with ZeroFilledBytes() as dense_probe:
            dense, dense_logps = dense_group_gradients(
                model, state, responses, advantages, config, prompt_grad=mode
            )
        with ZeroFilledBytes() as sliced_probe:
            slices, logps = group_gradient_on_ranks(
                model, state, responses, advantages, config, prompt_grad=mode
            )
        out[mode] = {
            **_slice_errors(slices, dense),
            "rows": {n: g.shape[0] for n, g in slices.grads.items()},
            "logps_equal": all(torch.equal(a, b) for a, b in zip(logps, dense_logps, strict=True)),
            "accumulator_bytes": slices.nbytes(),
            "dense_zero_filled_bytes": dense_probe.bytes,
            "sliced_zero_filled_bytes": sliced_probe.bytes,
            "scatter_bytes_sent": slices.bytes_sent,
            "scatter_bytes_received": slices.bytes_received,
            "grads_untouched": all(p.grad is None for p in params.values()),
        }
    return out


def fsdp_sliced_step(
    rank: int,
    world: int,
    checkpoint: str,
    data: int,
    prompt_len: int,
    shard_tokens: int,
    prompt_grad: str,
):
    """FSDP over the flattened (data, seq) mesh with sequence-sharded accumulators: DTensor grad
    shards vs the dense path's data-averaged gradient and the single-process engine; optimizer
    steps on the shards vs the single-process step and vs dense parameters."""
    import torch.distributed as dist
    from _group_gradients import dense_group_gradients, group_gradient_on_ranks
    from torch.distributed.tensor import DTensor

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.distributed.fsdp import (
        DATA,
        SEQ,
        data_seq_mesh,
        mesh_topology,
        set_sharded_gradients,
        shard_model_over_data_and_seq,
        unsharded_parameters,
    )
    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.schemas.grpo import GRPOConfig

    seq = world // data
    config = GRPOConfig(beta=0.0)
    lr = 1e-3

    reference, batches, want = data_parallel_reference(
        checkpoint, data, prompt_len, shard_tokens, prompt_grad, lr
    )

    mesh = data_seq_mesh(data, seq)
    seq_group = mesh.get_group(SEQ)
    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    modules, _ = shard_model_over_data_and_seq(model, mesh)
    prompt, responses, advantages = batches[rank // seq]
    with unsharded_parameters(modules):
        state = prefill(
            model, prompt, shard_tokens=shard_tokens, exchange=CrossRankExchange(seq_group)
        )
        # The dense path, averaged over data: the reference the shards must equal.
        dense, _ = dense_group_gradients(
            model, state, responses, advantages, config, prompt_grad=prompt_grad,
            group=seq_group, data_group=mesh.get_group(DATA),
        )  # fmt: skip
        with ZeroFilledBytes() as probe:
            slices, _ = group_gradient_on_ranks(
                model, state, responses, advantages, config, prompt_grad=prompt_grad,
                group=seq_group, topology=mesh_topology(mesh),
            )  # fmt: skip
    accumulator_bytes = slices.nbytes()
    data_reduce_bytes = set_sharded_gradients(model, slices, mesh)
    params = dict(model.named_parameters())
    shard_max_rel = 0.0
    for name, g in dense.grads.items():
        chunks = torch.chunk(g, world)
        expected = chunks[rank] if rank < len(chunks) else g[:0]
        local = params[name].grad.to_local()
        assert local.shape == expected.shape, (name, local.shape, expected.shape)
        if local.numel():
            shard_max_rel = max(
                shard_max_rel, ((local - expected).abs().max() / g.abs().max()).item()
            )
    out = {
        "all_dtensor": all(isinstance(p, DTensor) for p in params.values()),
        "local_numel": sum(p.to_local().numel() for p in params.values()),
        "total_numel": sum(p.numel() for p in reference.parameters()),
        "shard_vs_dense_max_rel": shard_max_rel,
        "grad": max(
            ((params[n].grad.full_tensor() - g).abs().max() / g.abs().max()).item()
            for n, g in want.grads.items()
        ),
        "accumulator_bytes": accumulator_bytes,
        "zero_filled_bytes": probe.bytes,
        "scatter_bytes_sent": slices.bytes_sent,
        "data_reduce_bytes": data_reduce_bytes,
        "flat_rank": dist.get_rank(),
    }
    dense_model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    for name, p in dense_model.named_parameters():
        p.grad = params[name].grad.full_tensor()
    torch.optim.SGD(model.parameters(), lr=lr).step()
    torch.optim.SGD(dense_model.parameters(), lr=lr).step()
    ref_params = dict(reference.named_parameters())
    eps = torch.finfo(torch.float32).eps
    out["sgd_vs_single_process"] = max(
        (
            (params[n].full_tensor() - p).abs().max()
            / (lr * 1e-5 * want.grads[n].abs().max() + 2 * eps * p.abs().max())
        ).item()
        for n, p in ref_params.items()
    )
    adam = torch.optim.AdamW(model.parameters(), lr=lr)
    adam.step()
    torch.optim.AdamW(dense_model.parameters(), lr=lr).step()
    out["adam_state_local_numel"] = sum(
        s["exp_avg"].to_local().numel() for s in adam.state.values()
    )
    out["steps_vs_dense_same_grad"] = max(
        (params[n].full_tensor() - p).abs().max().item() for n, p in dense_model.named_parameters()
    )
    # The same processes and mesh, a LoRA policy: the frozen base and the adapters sharded at
    # rest together, the adapters' gradient slices reduced into their FSDP shards.
    out["lora"] = _lora_sliced_step(
        rank, world, checkpoint, mesh, batches, shard_tokens, prompt_grad
    )
    return out


def _lora_sliced_step(rank, world, checkpoint, mesh, batches, shard_tokens, prompt_grad) -> dict:
    """A peft LoRA policy (rank-4 adapters on every linear layer, both factors random, the same
    seed on every rank) through `fsdp_sliced_step`'s path: each adapter's gathered DTensor
    gradient against the single-process engine's, averaged over the data replicas' groups."""
    from _group_gradients import group_gradient_on_ranks
    from torch.distributed.tensor import DTensor

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.distributed.fsdp import (
        SEQ,
        mesh_topology,
        set_sharded_gradients,
        shard_model_over_data_and_seq,
        unsharded_parameters,
    )
    from longstraw.engine.group import GradBuffer, accumulate_group_gradients
    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.models.lora import with_lora
    from longstraw.schemas.grpo import GRPOConfig
    from longstraw.schemas.run import EngineConfig, LoraConfig

    settings = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False)
    config = GRPOConfig(beta=0.0)
    data, seq = mesh.size(0), mesh.size(1)

    def lora_model():
        model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
        model.eval()
        return with_lora(model, settings, seed=5)

    reference = lora_model()
    want = GradBuffer(reference)
    for prompt, responses, advantages in batches:
        accumulate_group_gradients(
            reference, prompt, responses, advantages, config,
            EngineConfig(shard_tokens=shard_tokens, prompt_grad=prompt_grad), grad_buffer=want,
        )  # fmt: skip
    for grad in want.grads.values():
        grad /= data

    model = lora_model()
    modules, _ = shard_model_over_data_and_seq(model, mesh)
    prompt, responses, advantages = batches[rank // seq]
    seq_group = mesh.get_group(SEQ)
    with unsharded_parameters(modules):
        state = prefill(
            model, prompt, shard_tokens=shard_tokens, exchange=CrossRankExchange(seq_group)
        )
        slices, _ = group_gradient_on_ranks(
            model, state, responses, advantages, config, prompt_grad=prompt_grad,
            group=seq_group, topology=mesh_topology(mesh),
        )  # fmt: skip
    set_sharded_gradients(model, slices, mesh)
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    return {
        "trainable": sorted(trainable) == sorted(want.grads),
        "only_adapters": all(".lora_A." in n or ".lora_B." in n for n in trainable),
        "base_without_grad": all(params[n].grad is None for n in params if n not in trainable),
        "all_dtensor": all(isinstance(p, DTensor) for p in params.values()),
        "accumulator_numel": sum(g.numel() for g in slices.grads.values()),
        "adapter_numel": sum(params[n].numel() for n in trainable),
        "grad": max(
            ((params[n].grad.full_tensor() - g).abs().max() / g.abs().max()).item()
            for n, g in want.grads.items()
        ),
        "world": world,
    }


def glm_slices(rank: int, world: int, checkpoint: str, prompt_len: int, shard_tokens: int):
    """GLM-5: slices vs the dense path in both modes (the exact sweep's owner scatters through
    the MLA serve loop's OP_GRADIENT_SLICES)."""
    from _group_gradients import dense_group_gradients, group_gradient_on_ranks

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.schemas.grpo import GRPOConfig

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    prompt, responses, advantages = _group(model.config.get_text_config().vocab_size, prompt_len)
    config = GRPOConfig(beta=0.0)
    state = prefill(model, prompt, shard_tokens=shard_tokens, exchange=CrossRankExchange())
    out = {}
    for mode in ("detached", "exact"):
        dense, _ = dense_group_gradients(
            model, state, responses, advantages, config, prompt_grad=mode
        )
        slices, _ = group_gradient_on_ranks(
            model, state, responses, advantages, config, prompt_grad=mode
        )
        out[mode] = {
            **_slice_errors(slices, dense),
            "scatter_bytes_sent": slices.bytes_sent,
            "scatter_bytes_received": slices.bytes_received,
        }
    return out
