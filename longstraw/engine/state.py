"""The frozen prompt state: what survives the prefill of `prompt[:-1]`.

Legend: L layers of one kind, T = P - 1 state tokens, K kv heads, D head dim, S shards,
C conv channels, W conv tail (kernel - 1), H value heads, Dk/Dv key/value head dims.

Full-attention K/V are preallocated once at their final size and filled shard by shard, so the
prefill never concatenates or copies them. Linear-attention state is checkpointed at every shard
boundary: index s is the state at the start of shard s, index S the final state that branches
start from. Checkpoints live beside the model (CPU here) and are reported by `checkpoint_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw.engine.layer_kinds import (
    CHECKPOINT_ARRAYS,
    TOKEN_ARRAYS,
    allocate_state_arrays,
    named_arrays,
    nbytes,
    state_array_by_storage_name,
)
from longstraw.models.adapters import StateSpec


def stored_slice(array, slot: int, start: int, end: int) -> torch.Tensor:
    """[end - start, *X] of slot `slot` of a state or cotangent array, resident or tiered."""
    if hasattr(array, "read"):
        return array.read(slot, start, end)
    return array[slot, start:end]


def token_rows(array, start: int, end: int) -> torch.Tensor:
    """[L, end - start, *X] of a per-token array, resident or tiered (read slot by slot)."""
    if hasattr(array, "read"):
        return torch.stack([array.read(slot, start, end) for slot in range(array.shape[0])])
    return array[:, start:end]


def shard_bounds(num_tokens: int, shard_tokens: int) -> tuple[tuple[int, int], ...]:
    """[start, end) of each prefill shard over `num_tokens` positions; the last may be shorter."""
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    return tuple(
        (start, min(start + shard_tokens, num_tokens))
        for start in range(0, num_tokens, shard_tokens)
    )


@dataclass
class PrefixState:
    """Per-layer state of a prompt's first P - 1 tokens, computed once without autograd."""

    spec: StateSpec
    prompt_ids: torch.Tensor
    """[P] int64 prompt tokens: the reverse sweep recomputes shards from them (8 bytes/token)."""
    shard_tokens: int
    bounds: tuple[tuple[int, int], ...]
    keys: torch.Tensor | None
    """[L, T, K, D] full-attention keys after RoPE and k-norm, model dtype."""
    values: torch.Tensor | None
    """[L, T, K, Dv] full-attention values, model dtype."""
    conv: torch.Tensor | None
    """[L, S + 1, C, W] conv tails at every shard start and the end, model dtype."""
    recurrent: torch.Tensor | None
    """[L, S + 1, H, Dk, Dv] Gated DeltaNet recurrent state at every shard start and the end, fp32."""
    latent: torch.Tensor | None = None
    """[L, T, R] MLA latent after `kv_a_layernorm` (GLM-5), model dtype; nothing decompressed."""
    rope_key: torch.Tensor | None = None
    """[L, T, E] MLA shared rope key after RoPE, model dtype."""
    indexer_key: torch.Tensor | None = None
    """[L_idx, T, Di] DSA indexer keys of the layers with their own indexer, model dtype."""
    tiers: object | None = None
    """The `longstraw.engine.state_tiers.TieredState` streaming this state; None: resident."""

    @property
    def prompt_len(self) -> int:
        """P: tokens in the prompt. The state covers positions [0, P - 1)."""
        return self.prompt_ids.numel()

    @property
    def last_token_id(self) -> int:
        """The prompt's last token, replayed inside every branch (its output predicts y_1)."""
        return int(self.prompt_ids[-1])

    @property
    def num_tokens(self) -> int:
        return self.prompt_len - 1

    @property
    def num_shards(self) -> int:
        return len(self.bounds)

    @classmethod
    def allocate(
        cls,
        spec: StateSpec,
        *,
        prompt_ids: torch.Tensor,
        shard_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> PrefixState:
        num_tokens = prompt_ids.numel() - 1
        bounds = shard_bounds(num_tokens, shard_tokens)
        arrays = allocate_state_arrays(
            spec, num_tokens=num_tokens, num_checkpoints=len(bounds) + 1, dtype=dtype, device=device
        )
        return cls(spec, prompt_ids.cpu(), shard_tokens, bounds, **arrays)

    def final_linear_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([C, W], [H, Dk, Dv]) Gated DeltaNet layer `slot`'s state after the whole prompt."""
        return self.conv[slot, self.num_shards], self.recurrent[slot, self.num_shards]

    def final_linear_state_all(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([L, C, W], [L, H, Dk, Dv]) every Gated DeltaNet layer's state after the prompt
        ((None, None) without such layers)."""
        if self.conv is None:
            return None, None
        return self.conv[:, self.num_shards], self.recurrent[:, self.num_shards]

    @classmethod
    def from_tensors(
        cls,
        spec: StateSpec,
        *,
        prompt_ids: torch.Tensor,
        shard_tokens: int,
        tensors: dict[str, torch.Tensor],
    ) -> PrefixState:
        """A state around existing arrays (read back from storage), by their `tensors()` names."""
        fields = {state_array_by_storage_name(name).field: t for name, t in tensors.items()}
        return cls(
            spec,
            prompt_ids.cpu(),
            shard_tokens,
            shard_bounds(prompt_ids.numel() - 1, shard_tokens),
            fields.pop("keys", None),
            fields.pop("values", None),
            fields.pop("conv", None),
            fields.pop("recurrent", None),
            **fields,
        )

    def prefix_keys(self, layer_idx: int, end: int | None = None) -> torch.Tensor:
        """[T', K, D] view of the keys of model layer `layer_idx` before position `end`."""
        slot = self.spec.full_attention_slot(layer_idx)
        return self.keys[slot, : self.num_tokens if end is None else end]

    def prefix_values(self, layer_idx: int, end: int | None = None) -> torch.Tensor:
        slot = self.spec.full_attention_slot(layer_idx)
        return self.values[slot, : self.num_tokens if end is None else end]

    def conv_at(self, layer_idx: int, shard: int) -> torch.Tensor:
        """[C, W] conv tail of `layer_idx` at the start of `shard` (shard == S: the final tail)."""
        return self.conv[self.spec.linear_attention_slot(layer_idx), shard]

    def recurrent_at(self, layer_idx: int, shard: int) -> torch.Tensor:
        """[H, Dk, Dv] fp32 recurrent state of `layer_idx` at the start of `shard`."""
        return self.recurrent[self.spec.linear_attention_slot(layer_idx), shard]

    def state_bytes(self) -> int:
        """Bytes of the per-token part (K/V, MLA latents): what grows with the prompt."""
        return nbytes(getattr(self, a.field) for a in TOKEN_ARRAYS)

    def checkpoint_bytes(self) -> int:
        """Bytes of the per-shard linear-attention checkpoints (host memory)."""
        return nbytes(getattr(self, a.field) for a in CHECKPOINT_ARRAYS)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state's arrays by storage name (docs/design.md, "Storage")."""
        return named_arrays(self)
