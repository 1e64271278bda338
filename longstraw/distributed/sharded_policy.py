"""A training policy sharded at rest over the run's ranks (FSDP2), gathered while it computes.

With `parallel.world_size: N` every rank of the run holds, between steps, 1/N of each
parameter (dim-0 rows, `torch.chunk` layout: `fully_shard` over the flattened ("data", "seq")
mesh, global rank g holding chunk g whatever the number of data-parallel replicas), the matching
fp32 AdamW moments and masters; it accumulates its replica's rows of each group's gradient
(`engine.group.group_gradient`'s sink over the ranks), which `replica_gradients.sum_over_replicas` turns into
exactly its chunk when there are several replicas. So the
optimizer state and gradient accumulators — 16 bytes per parameter in fp32 AdamW, against 2
for the bf16 weights — are divided by N, which is what lets a 27B policy train on 8 devices.

Lifecycle within a step (every call is collective, made by all ranks in the same order, which
`on_all_ranks` stages guarantee):

* `gather()` before the first stage that computes (prefill, rollout, scoring, backward): one
  all-gather per FSDP unit; while gathered `model.named_parameters()` are plain tensors and the
  engine runs unchanged. The weights stay gathered for the rest of the step.
* `to_rest()` before the optimizer step: the gathered copies are freed; `local_shards` are views
  into the sharded storage, so the optimizer's in-place update is what the next `gather` sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from longstraw.distributed.fsdp import data_seq_mesh, shard_model_over_data_and_seq
from longstraw.distributed.gradient_slices import SliceLayout
from longstraw.distributed.topology import Topology

_meshes: dict[tuple[str, int], DeviceMesh] = {}


def training_mesh(device_type: str, world_size: int) -> DeviceMesh:
    """The mesh FSDP shards the policy over: every rank of the run, flattened (global rank g
    holds chunk g); created once per process (creating it is collective)."""
    key = (device_type, world_size)
    if key not in _meshes:
        _meshes[key] = data_seq_mesh(1, world_size, device_type)
    return _meshes[key]


@dataclass
class ShardedWeights:
    """The FSDP units of one policy and whether their parameters are gathered now."""

    modules: list[FSDPModule]
    mesh: DeviceMesh
    topology: Topology
    """The run's ranks (`distributed.topology`): global rank g holds chunk g."""
    gathered: bool = False
    layout: SliceLayout = field(init=False)

    def __post_init__(self) -> None:
        # Every rank of the run as one slice group: the chunks are over the whole world.
        self.layout = SliceLayout(self.topology.rank, self.topology.world_size, 1)

    def gather(self) -> None:
        """All-gather every unit's parameters (no-op when they are gathered already)."""
        if not self.gathered:
            for module in self.modules:
                module.unshard()
            self.gathered = True

    def to_rest(self) -> None:
        """Free the gathered parameters; only this rank's shards remain."""
        if self.gathered:
            for module in self.modules:
                module.reshard()
            self.gathered = False

    def rows(self, dim0: int) -> tuple[int, int]:
        """(start, end) of the dim-0 rows of a parameter with `dim0` rows this rank holds."""
        (piece,) = self.layout.pieces(dim0)
        return piece

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the ranks (a small tensor; moved to the collective's device)."""
        device = "cuda" if self.mesh.device_type == "cuda" else "cpu"
        out = value.to(device)
        dist.all_reduce(out)
        return out.cpu()


def shard_policy(model: PreTrainedModel, topology: Topology) -> ShardedWeights:
    """Shard `model`'s parameters over every rank of `topology` (collective: every rank, same
    model)."""
    mesh = training_mesh("cuda" if model.device.type == "cuda" else "cpu", topology.world_size)
    modules, _ = shard_model_over_data_and_seq(model, mesh)
    return ShardedWeights(modules=modules, mesh=mesh, topology=topology)


def local_shards(model: PreTrainedModel) -> list[tuple[str, torch.Tensor]]:
    """[(name, this rank's rows)] of the trainable parameters, at rest: views that write through
    to the sharded storage (what the optimizer updates in place)."""
    out = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if not isinstance(param, DTensor):
            raise RuntimeError(f"{name} is not sharded: call ShardedWeights.to_rest() first")
        out.append((name, param.to_local().detach()))
    return out


def full_state_dict(
    model: PreTrainedModel, weights: ShardedWeights, *, copy: bool, trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """The whole weights (parameters and persistent buffers) on the CPU, from the gathered
    parameters: what `save_pretrained(state_dict=...)` writes. Gathers first if needed (so
    every rank calls it); only a rank with `copy` makes the CPU copy ({} elsewhere).
    `trainable_only`: the trainable parameters alone (a LoRA policy's adapters: what peft's
    `save_pretrained` keeps of a state dict), not the frozen base."""
    weights.gather()
    if not copy:
        return {}
    if trainable_only:
        return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    out = {name: p.detach().cpu() for name, p in model.named_parameters()}
    for prefix, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buffer.detach().cpu()
    return out
