"""LoRA adapters on the policy through peft (`model.lora`), applied where the policy is loaded.

The policy of a LoRA run is peft's `PeftModel` over the transformers model: peft replaces each
targeted `nn.Linear` by its `lora.Linear` (and wraps MoE expert stacks and routers in
`lora.ParamWrapper`, which adds the delta to the parameter while the module runs), freezes the
base, and the trainable parameters are the adapters. Everything transformers calls as a module
then runs peft's forward, so the low-rank path is in every graph autograd differentiates. What
the engine computes by hand reads weights instead of calling modules; there:

- `linear_weight(module)` is the weight a hand-written path uses: a plain `nn.Linear`'s own, a
  peft `lora.Linear`'s base weight plus its active adapters' delta (differentiable, so the
  adapters get their gradient through it), and for any other wrapper an error naming the module
  — never the base weight of a layer whose wrapper adds something (GLM-5's absorbed latent
  attention reads `kv_b_proj` this way);
- `linear_parts(module)` gives the blockwise MLP backward a projection's plain base layer and
  its adapter's factors (A, B, scale), whose low-rank path it then takes by hand; a projection
  it cannot split so (`is_plain_linear` false, and not such an adapter) runs as a module and
  autograd differentiates it.

`unwrapped(model)` is the transformers model under a `PeftModel`, which the engine runs; the
`PeftModel` is what saves the adapters in peft's format (`save_adapter`) and what disables them
for the KL reference (`PeftModel.disable_adapter`: the base, no second copy).

Adapters are created on the CPU from a seeded generator (`with_lora`), so every process and
every rank of a run starts from the same adapter, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from longstraw.errors import UserError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_lora_checkpoint(path: str | Path) -> bool:
    """Whether `path` holds a peft adapter (adapter_config.json) rather than a whole model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base_path(path: str | Path) -> str | None:
    """The base model a peft adapter directory names (`base_model_name_or_path`)."""
    return json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")


def _peft():
    """peft's package once anything imported it (a model without one holds no adapter)."""
    return sys.modules.get("peft")


def is_peft_model(model: nn.Module) -> bool:
    peft = _peft()
    return peft is not None and isinstance(model, peft.PeftModel)


def unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model a `PeftModel` wraps (its adapters inside); any other model as is."""
    return model.get_base_model() if is_peft_model(model) else model


def peft_lora_config(settings):
    """peft's `LoraConfig` of a run's `model.lora` section (`longstraw.schemas.run.LoraConfig`)."""
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", **settings.model_dump())


def with_lora(model: nn.Module, settings, *, seed: int):
    """`model` (on the CPU) with fresh adapters of `settings` injected: a `PeftModel` whose only
    trainable parameters are the adapters. Their random initialisation is drawn from `seed`
    alone, so every process builds the same adapters. Raises UserError for targets the model
    does not have, or adapters LongStraw cannot train (`check_lora_supported`)."""
    from peft import get_peft_model

    config = peft_lora_config(settings)
    _check_no_unsupported_target(model, config)
    training = model.training
    with torch.random.fork_rng(devices=[]), _peft_warnings_quiet():
        torch.manual_seed(seed)
        try:
            peft_model = get_peft_model(model, config)
        except ValueError as err:
            raise UserError(
                f"model.lora: peft cannot apply it to this model ({_first_line(err)}) — "
                "fix model.lora.target_modules (or the field peft names)"
            ) from err
    # peft's new layers start in training mode: the policy keeps the mode it had (eval, for the
    # engine), so the adapters' dropout draws only where `adapter_dropout_training` asks.
    peft_model.train(training)
    check_lora_supported(peft_model)
    _check_every_target_matched(peft_model, settings.target_modules)
    return peft_model


# Layers an adapter cannot be trained on here, and why (peft may wrap some of them).
_UNSUPPORTED_TARGETS = {
    nn.Conv1d: "transformers' Gated DeltaNet reads its weight without calling the module, so an "
    "adapter there would be skipped",
    nn.Embedding: "LongStraw trains adapters on linear layers (and the MoE parameters peft wraps)",
}


def _check_no_unsupported_target(model: nn.Module, config) -> None:
    """UserError naming the first module `config.target_modules` reaches that is a layer kind
    LongStraw cannot train an adapter on (before peft, which words some of them otherwise)."""
    if config.target_modules == "all-linear":
        return  # linear layers (and the MoE parameters peft wraps) only
    from peft.tuners.tuners_utils import check_target_module_exists

    for name, module in model.named_modules():
        why = next(
            (w for kind, w in _UNSUPPORTED_TARGETS.items() if isinstance(module, kind)), None
        )
        if why is not None and check_target_module_exists(config, name):
            raise UserError(
                f"model.lora.target_modules reaches {name} ({type(module).__name__}): {why} — "
                f"leave {name.rsplit('.', 1)[-1]} out of model.lora.target_modules (or add it "
                "to model.lora.exclude_modules)"
            )


def _check_every_target_matched(model: nn.Module, targets) -> None:
    """UserError naming a module name of `target_modules` (a list) that no adapter sits on: peft
    only refuses a list none of whose names matches."""
    if isinstance(targets, str):
        return
    names = [name for name, _ in adapter_layers(model)]
    parameters = {getattr(layer, "parameter_name", None) for _, layer in adapter_layers(model)}
    for target in targets:
        if target in parameters or any(n == target or n.endswith(f".{target}") for n in names):
            continue
        adapted = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise UserError(
            f"model.lora.target_modules names {target}, but no adapter was placed there: the "
            f"model has no such linear layer (the others reached: {', '.join(adapted)}) — remove "
            f"{target} from model.lora.target_modules, or use `all-linear`"
        )


@contextlib.contextmanager
def _peft_warnings_quiet() -> Iterator[None]:
    """peft's warnings about its own defaults for fused MoE projections a model may not have,
    and a transformers deprecation peft calls into: nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys")
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated")
        yield


def load_lora(model: nn.Module, adapter_dir: str | Path):
    """`model` with the trainable adapters of the peft directory `adapter_dir` (a `PeftModel`)."""
    from peft import PeftModel

    training = model.training
    with _peft_warnings_quiet():
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    peft_model.train(training)
    check_lora_supported(peft_model)
    return peft_model


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def adapter_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """[(name, layer)] of every peft tuner layer in `model` (outermost wrappers only)."""
    peft = _peft()
    if peft is None:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    found = []
    inside = None  # the last layer found: modules below it come next (depth-first order)
    for name, module in model.named_modules():
        if inside is not None and name.startswith(inside):
            continue
        if isinstance(module, BaseTunerLayer):
            found.append((name, module))
            inside = f"{name}."
    return found


def check_lora_supported(model: nn.Module) -> None:
    """Raise UserError naming the first adapter LongStraw cannot train: one on a layer other than
    a linear layer or a parameter peft wraps (a Gated DeltaNet's `conv1d`, whose weight
    transformers reads without calling the module; an embedding), or a LoRA variant (DoRA)."""
    from peft.tuners import lora

    for name, layer in adapter_layers(model):
        base = layer.get_base_layer()
        if isinstance(layer, lora.Linear) and type(base) is nn.Linear:
            if layer.lora_variant:
                raise UserError(
                    f"model.lora reaches {name} with the variant {sorted(layer.lora_variant)}, "
                    "which LongStraw does not train — use plain LoRA"
                )
            continue
        if isinstance(layer, lora.ParamWrapper):
            continue
        why = (
            "transformers reads its weight without calling the module, so an adapter there would "
            "be skipped"
            if isinstance(base, nn.Conv1d)
            else "LongStraw trains adapters on linear layers (and the MoE parameters peft wraps) only"
        )
        raise UserError(
            f"model.lora.target_modules reaches {name} ({type(base).__name__}): {why} — leave "
            f"{name.rsplit('.', 1)[-1]} out of model.lora.target_modules (or add it to "
            "model.lora.exclude_modules)"
        )


def is_plain_linear(module: nn.Module) -> bool:
    """Exactly `torch.nn.Linear`: a hand-written path may read its weight and bias as the whole
    function (a subclass or a wrapper — peft's adapters, a quantised layer — may add to them)."""
    return type(module) is nn.Linear


def linear_parts(module: nn.Module) -> tuple[nn.Linear, tuple | None] | None:
    """(the plain `nn.Linear` under `module`, its adapter as (A [r, in], B [out, r], scale) or
    None) when `module` computes exactly `base(x) + scale · (x Aᵀ) Bᵀ`: a plain linear layer, or
    a peft `lora.Linear` with at most one active adapter, no dropout drawing masks, no LoRA
    variant and no bias on B. None for anything else (its module must be called)."""
    if is_plain_linear(module):
        return module, None
    peft = _peft()
    if peft is None:
        return None
    from peft.tuners import lora

    if not (isinstance(module, lora.Linear) and is_plain_linear(module.base_layer)):
        return None
    if module.merged:
        return None
    if module.disable_adapters:
        return module.base_layer, None
    active = [name for name in module.active_adapters if name in module.lora_A]
    if len(active) > 1:
        return None
    if not active:
        return module.base_layer, None
    (name,) = active
    dropout = module.lora_dropout[name]
    drawing = isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0
    if name in module.lora_variant or drawing or module.lora_B[name].bias is not None:
        return None
    return module.base_layer, (
        module.lora_A[name].weight,
        module.lora_B[name].weight,
        float(module.scaling[name]),
    )


def linear_weight(module: nn.Module, *, where: str) -> torch.Tensor:
    """The [out, in] weight `module` multiplies its input by, for a path that uses the weight
    instead of calling the module (`where` names it in errors).

    A plain `nn.Linear`: its weight. A peft `lora.Linear`: base weight + the active adapters'
    scaling × B A, formed in the adapters' dtype and added in the base's (peft's merge), so
    autograd takes the adapters' gradient through it; the base weight alone while the adapters
    are disabled (the KL reference). Anything else raises: a wrapper whose weight is not the
    whole function would be silently bypassed.
    """
    if is_plain_linear(module):
        return module.weight
    peft = _peft()
    if peft is not None:
        from peft.tuners import lora

        if isinstance(module, lora.Linear) and is_plain_linear(module.base_layer):
            return _lora_linear_weight(module, where)
    raise RuntimeError(
        f"{where} reads the weight of {type(module).__module__}.{type(module).__name__}, which "
        "wraps a linear layer in a way LongStraw does not know: its forward may add what the "
        "weight does not hold (an adapter) — use a plain nn.Linear or peft's LoRA there"
    )


def _lora_linear_weight(module, where: str) -> torch.Tensor:
    base = module.base_layer.weight
    if module.disable_adapters:
        if module.merged:
            module.unmerge()  # as peft's forward does with disabled adapters
        return base
    if module.merged:
        return base
    weight = base
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if name in module.lora_variant:
            raise RuntimeError(f"{where}: the LoRA variant of adapter {name!r} cannot be absorbed")
        dropout = module.lora_dropout[name]
        if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0:
            raise RuntimeError(
                f"{where} never forms this layer's input, so adapter dropout cannot be applied "
                "there — set model.lora.lora_dropout: 0 or exclude the layer from the adapters"
            )
        delta = module.lora_B[name].weight @ module.lora_A[name].weight
        weight = weight + (delta * module.scaling[name]).to(base.dtype)
    return weight


@contextlib.contextmanager
def adapter_dropout_training(model: nn.Module) -> Iterator[None]:
    """Inside the block the adapters' dropout draws masks (training mode), the rest of `model`
    stays as it is: the policy runs in eval mode (LongStraw's families have no dropout of their
    own), and a LoRA run's dropout belongs to the forward that is differentiated."""
    dropouts = [
        d
        for _, layer in adapter_layers(model)
        for d in getattr(layer, "lora_dropout", {}).values()
        if isinstance(d, nn.Dropout) and d.p > 0
    ]
    previous = [d.training for d in dropouts]
    for d in dropouts:
        d.train(True)
    try:
        yield
    finally:
        for d, mode in zip(dropouts, previous, strict=True):
            d.train(mode)


def has_adapter_dropout(model: nn.Module) -> bool:
    """Whether any adapter of `model` has a dropout probability above 0."""
    return any(
        isinstance(d, nn.Dropout) and d.p > 0
        for _, layer in adapter_layers(model)
        for d in getattr(layer, "lora_dropout", {}).values()
    )


def lora_summary(model: nn.Module) -> dict:
    """What makes a run a LoRA run, for run summaries and trackers: rank, alpha, the adapted
    module names (by their last component), adapters and trainable parameters."""
    layers = adapter_layers(model)
    config = next(iter(model.peft_config.values()))
    targets = sorted({name.rsplit(".", 1)[-1] for name, _ in layers})
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {
        "r": int(config.r),
        "lora_alpha": float(config.lora_alpha),
        "target_modules": targets,
        "adapted_layers": len(layers),
        "trainable_parameters": int(trainable),
        "total_parameters": int(total),
    }


def save_weights(model: nn.Module, directory: str | Path, state_dict=None) -> None:
    """Write what a checkpoint of `model` holds: a LoRA policy's adapters in peft's format
    (`save_adapter`), any other model's weights and config (`save_pretrained`)."""
    if is_peft_model(model):
        save_adapter(model, directory, state_dict)
    else:
        model.save_pretrained(str(directory), state_dict=state_dict)


def save_adapter(model: nn.Module, directory: str | Path, state_dict=None) -> None:
    """Write `model`'s adapters in peft's format (adapter_config.json, adapter_model.safetensors)
    into `directory`; `state_dict`: the whole model's (`PeftModel` names) when its own
    parameters are sharded."""
    model.save_pretrained(
        str(directory),
        state_dict=state_dict,
        safe_serialization=True,
        # The vocabulary is never resized: no embedding is saved, and peft asks nothing of the hub.
        save_embedding_layers=False,
    )


def merge_lora_checkpoint(
    adapter_dir: str | Path, out_dir: str | Path, *, base_dir: str | Path | None = None
) -> Path:
    """Write a Hugging Face checkpoint of the base with the adapters of `adapter_dir` merged
    into its weights (peft's `merge_and_unload`), in the base's dtype, with the tokenizer and
    LongStraw's weights record (the adapters' policy version); returns `out_dir`.

    `base_dir` defaults to the base the adapter names (`base_model_name_or_path`); when the
    adapter directory records its base's weights digest (a LongStraw checkpoint), the base must
    have it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longstraw.models.checkpoint import (
        METADATA_FILE,
        CheckpointMetadata,
        read_checkpoint_metadata,
        write_checkpoint_metadata,
    )

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    if not is_lora_checkpoint(adapter_dir):
        raise UserError(
            f"{adapter_dir} holds no {ADAPTER_CONFIG}: give a LoRA checkpoint directory (a LoRA "
            "run's checkpoints/vNNNNNN)"
        )
    base = Path(base_dir) if base_dir is not None else adapter_base_path(adapter_dir)
    if base is None or not (Path(base) / "config.json").is_file():
        raise UserError(
            f"the base model of {adapter_dir} ({base}) is not a checkpoint directory — pass the "
            "base with --base DIR"
        )
    record = adapter_dir / METADATA_FILE
    meta = CheckpointMetadata.model_validate_json(record.read_text()) if record.is_file() else None
    if meta is not None and meta.base_weights_digest is not None:
        found = read_checkpoint_metadata(base).weights_digest
        if found != meta.base_weights_digest:
            raise UserError(
                f"{adapter_dir} was trained on a base with weights digest "
                f"{meta.base_weights_digest[:12]}, but {base} has {found[:12]} — pass the base the "
                "run trained on with --base DIR"
            )
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype="auto")
    with _peft_warnings_quiet():
        merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    out_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(out_dir))
    tokenizer_source = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base
    AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(str(out_dir))
    write_checkpoint_metadata(out_dir, policy_version=0 if meta is None else meta.policy_version)
    return out_dir
