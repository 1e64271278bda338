"""Per-device memory of full-parameter and LoRA runs at real scale, projected on the meta device.

    .venv/bin/python bench/project_lora_memory.py --out bench/results/lora_projection.json

The models are built from their transformers configs on the meta device (no weights: Qwen3.5-27B
as tests/flows/test_example_configs.py describes it, GLM-5 as transformers' `GlmMoeDsaConfig`
defaults, 78 layers), LoRA adapters are injected there by peft (`longstraw.models.lora.with_lora`)
and counted. Everything else is arithmetic of what the engine holds, per device (docs/scaling.md):

- the base in bf16, gathered for the whole step (2 B/param; the policy is sharded at rest only);
- the trainable state: full-parameter fp32 masters + AdamW moments 12 B/param ÷ world and the
  gradient rows 4 B/param ÷ sequence ranks; LoRA adapters fp32 (peft keeps them so under a bf16
  base) gathered 4 B, AdamW 8 B ÷ world, gradient rows 4 B ÷ sequence ranks;
- the prompt state ÷ sequence ranks: K/V (MLA latents, rope and indexer keys) in bf16, and in
  exact mode its fp32 cotangent dS (GLM-5: no cotangent for the indexer keys);
- 15 GB for one shard's or one branch's activations (the allowance docs/scaling.md uses);
- where that does not fit, `engine.state_budget_bytes` = device − base − trainable state −
  activations: whole layers of K/V + dS stay resident, lowest first, with room for one working
  and one prefetched chunk unit (1024 positions of every streamed array of a layer); the rest
  waits in host memory.

No time is projected here: docs/scaling.md has the link and compute figures of streaming.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

GB = 1e9
DEVICES = {"H200": 141e9, "H20": 96e9}
ACTIVATIONS = 15e9
CHUNK_POSITIONS = 1024
MILLION = 2**20
# Qwen3.5-27B's text model (docs/design.md; tests/flows/test_example_configs.py builds it from here).
QWEN35_27B = dict(
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    vocab_size=248320,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
    tie_word_embeddings=False,
)
# Adapters of rank 16: on Qwen3.5-27B every linear layer but lm_head; on GLM-5 the attention
# projections (peft 0.21 maps `all-linear`, and MLP names such as `down_proj`, onto the fused
# routed-expert stacks of every MoE layer, whose delta it forms at the stack's full size on
# every forward: 2 × 256 experts × 6144 × 2048 values per layer).
QWEN_LORA = dict(r=16, lora_alpha=32, target_modules="all-linear")
GLM_LORA = dict(
    r=16,
    lora_alpha=32,
    target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
)


@dataclass(frozen=True)
class ModelFacts:
    name: str
    params: int
    """Parameters of the base."""
    layers_with_state: int
    """Layers whose per-token state streams (full-attention / MLA layers)."""
    state_bytes_per_token: int
    """bf16 K/V (latents, rope and indexer keys) of every such layer, per token."""
    cotangent_bytes_per_token: int
    """fp32 dS of every such layer, per token (exact mode)."""
    adapter_params: dict[str, int]
    """LoRA adapter parameters by setting name."""


def meta_model(model_type: str, **fields):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            AutoConfig.for_model(model_type, **fields), dtype=torch.bfloat16
        )


def _adapter_params(model_type: str, fields: dict, lora: dict) -> int:
    from longstraw.models.lora import with_lora
    from longstraw.schemas.run import LoraConfig

    model = meta_model(model_type, **fields)
    with torch.device("meta"):
        peft_model = with_lora(model, LoraConfig(**lora), seed=0)
    return sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def qwen35_27b() -> ModelFacts:
    from longstraw.models.adapters import state_spec

    model = meta_model("qwen3_5_text", **QWEN35_27B)
    kv = state_spec(model).full_attention
    per_layer = kv.num_kv_heads * (kv.head_dim + kv.value_head_dim)
    return ModelFacts(
        name="Qwen3.5-27B",
        params=sum(p.numel() for p in model.parameters()),
        layers_with_state=len(kv.layer_indices),
        state_bytes_per_token=len(kv.layer_indices) * per_layer * 2,
        cotangent_bytes_per_token=len(kv.layer_indices) * per_layer * 4,
        adapter_params={"r16": _adapter_params("qwen3_5_text", QWEN35_27B, QWEN_LORA)},
    )


def glm5() -> ModelFacts:
    from longstraw.models.adapters import state_spec

    model = meta_model("glm_moe_dsa")
    mla = state_spec(model).mla
    layers = len(mla.layer_indices)
    per_layer = mla.kv_lora_rank + mla.rope_dim
    indexer = len(mla.indexer_layer_indices) * mla.index_head_dim
    return ModelFacts(
        name="GLM-5",
        params=sum(p.numel() for p in model.parameters()),
        layers_with_state=layers,
        state_bytes_per_token=(layers * per_layer + indexer) * 2,
        cotangent_bytes_per_token=layers * per_layer * 4,
        adapter_params={"r16": _adapter_params("glm_moe_dsa", {}, GLM_LORA)},
    )


@dataclass(frozen=True)
class Setup:
    model: str
    tokens: int
    mode: str
    """exact or detached."""
    devices: int
    """Sequence ranks (one replica)."""
    device: str
    lora: str | None
    """Adapter setting name, None: every parameter trains."""


def project(facts: ModelFacts, setup: Setup, budget: float | None = None) -> dict:
    """Per-device bytes of `setup` (module docstring), and how the state fits: all resident when
    it does, else streamed under `budget` (default: what the device leaves for the state)."""
    n = setup.devices
    base = 2 * facts.params
    if setup.lora is None:
        trainable = 12 * facts.params / n + 4 * facts.params / n
    else:
        adapters = facts.adapter_params[setup.lora]
        trainable = 4 * adapters + 8 * adapters / n + 4 * adapters / n
    state = setup.tokens * facts.state_bytes_per_token / n
    cotangent = setup.tokens * facts.cotangent_bytes_per_token / n if setup.mode == "exact" else 0
    capacity = DEVICES[setup.device]
    resident_total = base + trainable + ACTIVATIONS + state + cotangent
    out = {
        # What a device would hold if the base stayed sharded during the step too (bf16 ÷ n):
        # not implemented — the engine gathers every parameter for the step.
        "sharded_base_total_bytes": base / n + trainable + ACTIVATIONS + state + cotangent,
        **asdict(setup),
        "base_bytes": base,
        "trainable_params": facts.params
        if setup.lora is None
        else facts.adapter_params[setup.lora],
        "trainable_state_bytes": trainable,
        "state_bytes": state,
        "cotangent_bytes": cotangent,
        "activation_bytes": ACTIVATIONS,
        "resident_total_bytes": resident_total,
        "capacity_bytes": capacity,
    }
    if resident_total <= capacity and budget is None:
        return out | {"fits": True, "tiered": False, "device_total_bytes": resident_total}
    if budget is None:
        budget = capacity - base - trainable - ACTIVATIONS
    layers = facts.layers_with_state
    layer = (state + cotangent) / layers
    chunk_unit = layer / (setup.tokens / n) * CHUNK_POSITIONS
    resident_layers = (
        max(0, min(layers, math.floor((budget - 2 * chunk_unit) / layer))) if budget > 0 else 0
    )
    device_state = resident_layers * layer + 2 * chunk_unit
    total = base + trainable + ACTIVATIONS + device_state
    return out | {
        "fits": budget > 2 * chunk_unit and total <= capacity,
        "tiered": True,
        "state_budget_bytes": budget,
        "layers_resident": resident_layers,
        "layers_streamed": layers - resident_layers,
        "device_state_bytes": device_state,
        "host_state_bytes": (layers - resident_layers) * layer,
        "device_total_bytes": total,
    }


def setups() -> list[Setup]:
    qwen, glm = "Qwen3.5-27B", "GLM-5"
    return [
        Setup(qwen, MILLION, "exact", 8, "H200", None),
        Setup(qwen, MILLION, "exact", 1, "H200", "r16"),
        Setup(qwen, MILLION, "detached", 1, "H200", "r16"),
        Setup(qwen, 2_100_000, "detached", 1, "H200", "r16"),
        Setup(qwen, MILLION, "exact", 8, "H20", None),
        Setup(qwen, MILLION, "exact", 8, "H20", "r16"),
        Setup(qwen, MILLION, "detached", 8, "H20", "r16"),
        Setup(qwen, 2_100_000, "detached", 8, "H20", "r16"),
        Setup(qwen, 2_100_000, "exact", 8, "H20", "r16"),
        Setup(glm, 2_100_000, "exact", 32, "H20", None),
        Setup(glm, 2_100_000, "exact", 32, "H20", "r16"),
        Setup(glm, 2_100_000, "detached", 32, "H20", "r16"),
    ]


def markdown(rows: list[dict]) -> str:
    head = (
        "| model, P, mode | devices | trains | base (bf16, gathered) | trainable state | "
        "K/V | dS | state on device (layers resident / streamed) | host | total | fits | "
        "untiered total, base sharded in the step |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        tokens = f"{r['tokens'] / 1e6:.1f} M" if r["tokens"] != MILLION else "1 M"
        trains = (
            "all"
            if r["lora"] is None
            else f"LoRA {r['lora']} ({r['trainable_params'] / 1e6:.0f} M)"
        )
        if r["tiered"]:
            state = f"{r['device_state_bytes'] / GB:.1f} ({r['layers_resident']} / {r['layers_streamed']})"
            host = f"{r['host_state_bytes'] / GB:.1f}"
        else:
            state, host = f"{(r['state_bytes'] + r['cotangent_bytes']) / GB:.1f} (all)", "0"
        # One device has nothing to shard the base over; the figure is untiered.
        sharded = "—" if r["devices"] == 1 else f"{r['sharded_base_total_bytes'] / GB:.1f}"
        lines.append(
            f"| {r['model']}, {tokens}, {r['mode']} | {r['devices']} × {r['device']} | {trains} "
            f"| {r['base_bytes'] / GB:.1f} | {r['trainable_state_bytes'] / GB:.2f} "
            f"| {r['state_bytes'] / GB:.1f} | {r['cotangent_bytes'] / GB:.1f} | {state} | {host} "
            f"| {r['device_total_bytes'] / GB:.1f} | {'yes' if r['fits'] else 'no'} "
            f"| {sharded} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/lora_projection.json"))
    args = parser.parse_args()
    facts = {f.name: f for f in (qwen35_27b(), glm5())}
    rows = [project(facts[s.model], s) for s in setups()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"models": {k: asdict(v) for k, v in facts.items()}, "rows": rows}, indent=2)
    )
    print(markdown(rows))


if __name__ == "__main__":
    main()
