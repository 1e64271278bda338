"""The shipped run configs: what the GPU deployment runs validates, overrides change only what
they name, and the Qwen3.5-27B example's model and per-rank state match the memory projection."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import yaml

from longstraw.flows.train import run_config
from longstraw.models.adapters import state_spec
from longstraw.storage.config_files import read_run_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "qwen35-27b-1m-8gpu.yaml"
TWO_NODES = ROOT / "examples" / "qwen35-27b-1m-2x8gpu.yaml"
GIB = 2**30


def _gpu_parameters() -> dict:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    (gpu,) = [d for d in spec["deployments"] if d["name"] == "gpu"]
    return gpu["parameters"]


def test_gpu_deployment_runs_the_example_config_and_overrides_change_only_what_they_name():
    params = _gpu_parameters()
    # The image ships the repository at /opt/longstraw.
    local = params["config_file"].replace("/opt/longstraw", str(ROOT))
    base = run_config(params["config"], local)
    assert base == read_run_config(str(EXAMPLE))
    renamed = run_config({"run_id": "x"}, local)
    assert renamed.run_id == "x"
    assert renamed.model_copy(update={"run_id": base.run_id}) == base
    deeper = run_config({"engine": {"prompt_grad": "detached"}}, local)
    assert deeper.engine.prompt_grad == "detached"
    assert deeper.engine.shard_tokens == base.engine.shard_tokens == 8192


def _qwen35_27b_on_meta():
    """Qwen3.5-27B's text model (the dimensions docs/design.md describes: 64 layers of hidden
    5120, every fourth full attention) on the meta device, as the memory projection builds it."""
    projection = _projection()
    return projection.meta_model("qwen3_5_text", **projection.QWEN35_27B)


def _gib_per_rank(config, model) -> tuple[float, float]:
    """(K/V, everything before activations) per rank of `config`'s run, for a 1M-token prompt:
    the prompt state over the sequence ranks, the policy at rest over all ranks."""
    params = sum(p.numel() for p in model.parameters())
    assert 26e9 < params < 28e9, params
    kv = state_spec(model).full_attention
    # K and V of every full-attention layer, bf16.
    per_token = len(kv.layer_indices) * kv.num_kv_heads * (kv.head_dim + kv.value_head_dim) * 2
    assert per_token == 64 * 1024
    tokens = 2**20
    sequence, ranks = config.parallel.sequence_ranks, config.parallel.world_size
    kv_rank = tokens * per_token / sequence
    dS_rank = 2 * kv_rank  # fp32 cotangent in exact mode
    weights_rank = params * 2 / ranks  # bf16, sharded at rest
    optimizer_rank = params * 12 / ranks  # fp32 master + Adam moments
    gradient_rank = params * 4 / sequence  # fp32 rows of the replica's gradient
    num_shards = -(-(tokens - 1) // config.engine.shard_tokens)
    assert num_shards % sequence == 0  # every rank owns the same number of shards
    total = kv_rank + dS_rank + weights_rank + optimizer_rank + gradient_rank
    return kv_rank / GIB, total / GIB


def test_qwen35_27b_example_instantiates_on_meta_and_its_state_fits_the_projection():
    config = read_run_config(str(EXAMPLE))
    assert (config.model.dtype, config.engine.prompt_grad) == ("bfloat16", "exact")
    assert (config.parallel.world_size, config.parallel.backend) == (8, "nccl")
    kv, total = _gib_per_rank(config, _qwen35_27b_on_meta())
    assert kv == pytest.approx(8.0)
    assert total < 131, f"{total:.1f} GiB per rank does not fit a 141 GB H200"


def test_two_node_example_is_two_replicas_of_eight_sequence_ranks_and_fits_per_rank():
    """16 GPUs: the prompt sharded 8 ways within each node's replica, as on one node; the policy
    at rest over all 16 ranks, so a rank holds less than on one node."""
    config = read_run_config(str(TWO_NODES))
    one_node = read_run_config(str(EXAMPLE))
    parallel = config.parallel
    assert (parallel.world_size, parallel.data_parallel, parallel.sequence_ranks) == (16, 2, 8)
    assert parallel.backend == "nccl"
    # Both replicas busy every step, each with the same number of groups.
    assert config.train.groups_per_step % parallel.data_parallel == 0
    assert config.model == one_node.model and config.engine == one_node.engine
    model = _qwen35_27b_on_meta()
    kv, total = _gib_per_rank(config, model)
    kv_one, total_one = _gib_per_rank(one_node, model)
    assert kv == pytest.approx(kv_one) == pytest.approx(8.0)
    assert total < total_one < 131, (total, total_one)


def test_torchrun_manifest_forms_the_world_its_command_names():
    service, job = yaml.safe_load_all((ROOT / "infra" / "k8s-torchrun-job.yaml").read_text())
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    command = container["args"][0].split()
    flags = dict(arg.split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)
    nodes, per_node = int(env["NODES"]), int(env["GPUS_PER_NODE"])
    assert nodes == spec["completions"]
    assert flags["--nnodes"] == "$(NODES)" and flags["--nproc-per-node"] == "$(GPUS_PER_NODE)"
    assert flags["--node-rank"] == "$(JOB_COMPLETION_INDEX)"
    host = flags["--rdzv-endpoint"].split(":")[0]
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(command[command.index("--world-size") + 1]) == nodes * per_node
    assert container["resources"]["limits"]["nvidia.com/gpu"] == per_node
    config_file = command[command.index("--config") + 1].replace("/opt/longstraw", str(ROOT))
    config = read_run_config(config_file)
    assert config.model.checkpoint.startswith("/models/")
    # The config's replicas × sequence ranks are the world torchrun forms: one replica a node.
    assert config.parallel.world_size == nodes * per_node
    assert config.parallel.data_parallel == nodes
    assert config.parallel.sequence_ranks == per_node


ONE_GPU_LORA = ROOT / "examples" / "qwen35-27b-1m-1gpu-lora.yaml"


@functools.cache
def _projection():
    """bench/project_lora_memory.py as a module: the projection docs/scaling.md tabulates."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        "project_lora_memory", ROOT / "bench" / "project_lora_memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses resolve their annotations through the module's entry in sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_one_gpu_lora_example_fits_an_h200_by_the_projection():
    """Qwen3.5-27B, 1M tokens, exact mode, on one H200: the frozen bf16 base, the adapters'
    training state, one shard's activations and the configured `state_budget_bytes` of K/V + dS
    fit 141 GB; the state beyond the budget waits in host memory."""
    projection = _projection()
    config = read_run_config(str(ONE_GPU_LORA))
    assert (config.model.dtype, config.engine.prompt_grad) == ("bfloat16", "exact")
    assert config.parallel.world_size == 1 and config.engine.state_tier == "host"
    lora = config.model.lora
    assert lora is not None
    assert lora.model_dump(include={"r", "lora_alpha", "target_modules"}) == projection.QWEN_LORA
    facts = projection.qwen35_27b()
    assert 26e9 < facts.params < 28e9 and facts.state_bytes_per_token == 64 * 1024
    setup = projection.Setup("Qwen3.5-27B", 2**20, "exact", 1, "H200", "r16")
    free = projection.project(facts, setup)
    assert free["tiered"] and free["fits"], free
    assert config.engine.state_budget_bytes <= free["state_budget_bytes"]
    row = projection.project(facts, setup, budget=config.engine.state_budget_bytes)
    assert row["fits"] and row["device_total_bytes"] <= projection.DEVICES["H200"], row
    # The adapters' whole training state is under 2 GB; every parameter's would be 430 GB.
    assert row["trainable_state_bytes"] < 2e9 < 16 * facts.params
    # Detached at 1M holds the whole K/V beside the base.
    detached = projection.Setup("Qwen3.5-27B", 2**20, "detached", 1, "H200", "r16")
    resident = projection.project(facts, detached)
    assert resident["fits"] and not resident["tiered"], resident
