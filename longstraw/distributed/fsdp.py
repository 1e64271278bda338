"""FSDP2 (`fully_shard`) over the data-parallel dimension of a ("data", "seq") mesh.

Parameters, their gradients and the optimizer state live sharded over "data" (each data rank
holds a 1/N_data slice of every tensor, `torch.distributed.tensor.DTensor`). The sequence
dimension keeps its own reduction: its ranks split ONE group's prompt and SUM their partial
gradients with the branch part counted once, which FSDP's averaging reduce-scatter cannot
express. So one group step is:

1. `unsharded_parameters(model)`: FSDP all-gathers every parameter once (one collective per
   FSDP module over "data"). While gathered, `model.named_parameters()` are plain tensors, so the
   engine (prefill, replay, sweep, fp32 `GradBuffer`) runs unchanged, and no FSDP hook issues a
   collective: `reshard_after_forward=False`, reshard after backward off and gradient sync off.
   That matters beyond speed: data replicas hold different prompts, so they run different numbers
   of shard forwards and branch backwards; per-forward all-gathers or per-backward
   reduce-scatters would pair unrelated calls across replicas and deadlock.
2. the group's fp32 gradient, summed over "seq" (the tests' dense reference,
   `tests/distributed/_group_gradients.py`).
3. `shard_gradients_over_data`: average over "data" and keep only this rank's slice, set as the
   sharded parameter's `.grad` (a DTensor with the parameter's placements); then FSDP reshards
   the parameters. The optimizer steps on the sharded parameters, so its state is sharded too.

The data-parallel reduction here is an all_reduce of the dense fp32 gradient followed by taking
the local slice: the reference. Training sums data replicas with a reduce-scatter of the slices
(`replica_gradients.sum_over_replicas`). See docs/scaling.md for what was measured.

Sequence-sharded accumulators (no dense fp32 gradient on any rank during the step):
`shard_model_over_data_and_seq` shards parameters, gradients and optimizer state over the
flattened mesh (rank (d, s) holds chunk d · N_s + s); `engine.group.group_gradient(...,
exchange=CrossRankExchange(seq, topology=mesh_topology(mesh)))` accumulates exactly the rows
that data ranks (·, s) will own; then
`set_sharded_gradients` all-reduces those slices over "data" and sets each DTensor `.grad`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from longstraw.distributed.gradient_slices import GradSlices, SliceLayout
from longstraw.distributed.topology import Topology
from longstraw.engine.group import GradBuffer
from longstraw.models.adapters import decoder_of

DATA, SEQ = "data", "seq"
# The flattened ("data", "seq") mesh: global rank order, i.e. d · N_s + s.
DATA_SEQ = "data_seq"


def data_seq_mesh(data: int, seq: int, device_type: str = "cpu") -> DeviceMesh:
    """The 2-D mesh: consecutive global ranks form a sequence group (they share one prompt)."""
    return init_device_mesh(device_type, (data, seq), mesh_dim_names=(DATA, SEQ))


def shard_model(model: PreTrainedModel, mesh: DeviceMesh) -> list[FSDPModule]:
    """`fully_shard` the model over the mesh's "data" dimension; returns the FSDP modules.

    Units: each decoder layer, the embedding, the decoder (final norm) and `lm_head` separately:
    the engine calls the decoder and `lm_head` itself, so a root unit around the whole model
    would never see its forward hook (docs/scaling.md).
    """
    return _fully_shard_units(model, mesh[DATA])


def _fully_shard_units(model: PreTrainedModel, shard_mesh: DeviceMesh) -> list[FSDPModule]:
    if model.config.get_text_config().tie_word_embeddings:
        raise ValueError(
            "shard_model shards embed_tokens and lm_head as separate units; tied embeddings "
            "(tie_word_embeddings=True) would share one parameter between two units"
        )
    decoder = decoder_of(model)
    units: list[torch.nn.Module] = [*decoder.layers, decoder.embed_tokens, decoder, model.lm_head]
    for unit in units:
        fully_shard(unit, mesh=shard_mesh, reshard_after_forward=False)
    modules = [unit for unit in units if isinstance(unit, FSDPModule)]
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
        module.set_reshard_after_backward(False, recurse=False)
    return modules


@contextlib.contextmanager
def unsharded_parameters(modules: list[FSDPModule]) -> Iterator[None]:
    """All-gather every FSDP unit's parameters for the block; reshard after (collective)."""
    for module in modules:
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()


def local_slice(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's part of `full` in `param`'s layout (FSDP2: dim 0 in torch.chunk pieces)."""
    return torch.distributed.tensor.distribute_tensor(
        full, param.device_mesh, param.placements, src_data_rank=None
    ).to_local()


def shard_gradients_over_data(model: PreTrainedModel, grads: GradBuffer, mesh: DeviceMesh) -> None:
    """Average `grads` (dense fp32, by name) over "data"; set each sharded parameter's `.grad`.

    Call after `unsharded_parameters` has resharded (the parameters are DTensors again).
    """
    data_group = mesh.get_group(DATA)
    size = dist.get_world_size(data_group)
    for name, param in model.named_parameters():
        if name not in grads.grads:
            continue
        full = grads.grads[name]
        dist.all_reduce(full, group=data_group)
        full /= size
        assert isinstance(param, DTensor), f"{name} is not sharded: call shard_model first"
        local = local_slice(full, param).to(param.dtype)
        grad = DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
        param.grad = grad if param.grad is None else param.grad + grad


def shard_model_over_data_and_seq(
    model: PreTrainedModel, mesh: DeviceMesh
) -> tuple[list[FSDPModule], DeviceMesh]:
    """`fully_shard` the model over the FLATTENED ("data", "seq") mesh: rank (d, s) holds chunk
    d · N_s + s of every parameter's dim 0, and so do its gradient and optimizer state.

    Returns the FSDP modules and the flat mesh. Pair with `engine.group.group_gradient` over
    `CrossRankExchange(seq, topology=mesh_topology(mesh))` and `set_sharded_gradients`: the sequence-sharded accumulators hold exactly
    the rows that the data reduction turns into these chunks. `unsharded_parameters` then
    all-gathers over all ranks once per step (every rank takes part, in the same order).
    """
    flat = DeviceMesh(mesh.device_type, mesh.mesh.flatten(), mesh_dim_names=(DATA_SEQ,))
    return _fully_shard_units(model, flat), flat


def mesh_topology(mesh: DeviceMesh) -> Topology:
    """The ("data", "seq") mesh as the run's `Topology`: rank (d, s) is the one at d · N_s + s of
    the flattened mesh."""
    flat = mesh.mesh.flatten().tolist()
    return Topology(len(flat), mesh.size(0), flat.index(dist.get_rank()))


def slice_layout(mesh: DeviceMesh) -> SliceLayout:
    """This rank's `SliceLayout` on the ("data", "seq") mesh (what `set_sharded_gradients` expects)."""
    return SliceLayout.of(mesh_topology(mesh))


def set_sharded_gradients(model: PreTrainedModel, slices: GradSlices, mesh: DeviceMesh) -> int:
    """Average this rank's gradient slices over "data"; set each parameter's DTensor `.grad` to
    its FSDP shard (`shard_model_over_data_and_seq`). Returns the bytes handed to collectives.

    Rank (d, s) keeps piece d of the averaged slice: chunk d · N_s + s, FSDP's layout. The
    reduction is an all_reduce of the slice (1/N_s of the fp32 gradient; gloo has no
    reduce_scatter for CPU tensors) — a reduce_scatter over "data" would send 1/N_d of that.
    Call after `unsharded_parameters` has resharded (the parameters are DTensors again). The
    slices are averaged in place (consumed).
    """
    layout = slices.layout
    assert layout == slice_layout(mesh), f"slices {layout} do not match the mesh {mesh}"
    data_group = mesh.get_group(DATA)
    data_rank = mesh.get_local_rank(DATA)
    sent = 0
    for name, param in model.named_parameters():
        if name not in slices.grads:
            continue
        assert isinstance(param, DTensor), (
            f"{name} is not sharded: call shard_model_over_data_and_seq"
        )
        part = slices.grads[name]
        if layout.data_size > 1:
            dist.all_reduce(part, group=data_group)
            part /= layout.data_size
            sent += part.numel() * part.element_size()
        pieces = slices.pieces[name]
        offset = sum(end - start for start, end in pieces[:data_rank])
        start, end = pieces[data_rank]
        local = part[offset : offset + end - start].to(param.dtype)
        assert local.shape == param.to_local().shape, (name, local.shape, param.to_local().shape)
        grad = DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
        param.grad = grad if param.grad is None else param.grad + grad
    return sent
