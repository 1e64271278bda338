"""The per-kind layer factory covers every kind of layer a `StateSpec` can describe."""

from __future__ import annotations

import dataclasses
import typing

import torch
from transformers import AutoConfig

from longstraw.engine import layer_kinds
from longstraw.engine.layer_kinds import (
    LAYER_KINDS,
    STATE_ARRAYS,
    STATE_FIELDS,
    allocate_state_arrays,
)
from longstraw.engine.replay import PromptCotangent
from longstraw.engine.state import PrefixState
from longstraw.models import adapters
from longstraw.models.adapters import StateSpec


def _kind_fields() -> set[str]:
    """StateSpec's fields that describe a kind of layer (typed `<Something>Spec | None`)."""
    hints = typing.get_type_hints(StateSpec, vars(adapters))
    return {
        f.name
        for f in dataclasses.fields(StateSpec)
        if any(
            isinstance(arg, type) and arg.__name__.endswith("Spec")
            for arg in typing.get_args(hints[f.name])
        )
    }


def test_every_kind_of_the_state_spec_has_one_layer_kind():
    fields = [kind.field for kind in LAYER_KINDS]
    assert len(fields) == len(set(fields)) == 3
    assert set(fields) == _kind_fields()
    for kind in LAYER_KINDS:
        methods = ("allocate", "output_hooks", "branch_layer", "prefill_layer", "sweep_layer")
        for method in (*methods, "segment_layer"):
            assert getattr(type(kind), method) is not getattr(layer_kinds.LayerKind, method), (
                f"{type(kind).__name__} does not define {method}"
            )


def test_allocated_arrays_are_the_state_fields_of_the_models_kinds(checkpoint_dir):
    for family in ("qwen3_5", "glm_moe_dsa"):
        spec = adapters.state_spec(AutoConfig.from_pretrained(checkpoint_dir(family)))
        ids = torch.arange(64)
        state = PrefixState.allocate(spec, prompt_ids=ids, shard_tokens=24, dtype=torch.float32)
        arrays = allocate_state_arrays(
            spec, num_tokens=63, num_checkpoints=4, dtype=torch.float32, device="cpu"
        )
        assert set(arrays) == set(STATE_FIELDS)
        for name in STATE_FIELDS:
            stored, fresh = getattr(state, name), arrays[name]
            assert (stored is None) == (fresh is None), (family, name)
            if fresh is not None:
                assert stored.shape == fresh.shape and stored.dtype == fresh.dtype, (family, name)
        present = {name for name in STATE_FIELDS if arrays[name] is not None}
        expected = {
            "qwen3_5": {"keys", "values", "conv", "recurrent"},
            "glm_moe_dsa": {"latent", "rope_key", "indexer_key"},
        }[family]
        assert present == expected, (family, present)


def test_declared_arrays_are_fields_of_the_state_and_its_cotangent():
    state_fields = {f.name for f in dataclasses.fields(PrefixState)}
    cotangent_fields = {f.name for f in dataclasses.fields(PromptCotangent)}
    storage_names = [a.storage_name for a in STATE_ARRAYS]
    assert len(set(storage_names)) == len(storage_names) == len(STATE_FIELDS)
    for kind in LAYER_KINDS:
        for array in kind.arrays:
            assert array.storage_name.startswith(f"{kind.field}/") or kind.field == "mla"
            assert array.field in state_fields, array
            assert (array.field in cotangent_fields) == array.has_cotangent, array


def test_a_state_rebuilt_from_its_stored_arrays_keeps_every_array(checkpoint_dir):
    # What persisted prefill does with a committed state; GLM-5's latents were dropped once.
    for family in ("qwen3_5", "glm_moe_dsa"):
        spec = adapters.state_spec(AutoConfig.from_pretrained(checkpoint_dir(family)))
        ids = torch.arange(64)
        state = PrefixState.allocate(spec, prompt_ids=ids, shard_tokens=24, dtype=torch.float32)
        for tensor in state.tensors().values():
            tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(42)))
        rebuilt = PrefixState.from_tensors(
            spec, prompt_ids=ids, shard_tokens=24, tensors=state.tensors()
        )
        assert rebuilt.tensors().keys() == state.tensors().keys(), family
        for name, tensor in state.tensors().items():
            assert torch.equal(rebuilt.tensors()[name], tensor), (family, name)
