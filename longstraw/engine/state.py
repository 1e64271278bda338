"""The frozen prompt state: what survives the prefill of `prompt[:-1]`, and where it lives.

Legend: L layers of one kind, T = P - 1 state tokens, T_r the positions this rank holds,
K kv heads, D head dim, S shards, n_r the shards this rank owns, C conv channels, W conv tail
(kernel - 1), H value heads, Dk/Dv key/value head dims.

One state type at every world size. Its `Placement` says which part of the prompt this process
holds: rank r of a sequence group of N owns a contiguous range of prefill shards (the first
S % N ranks one more) and so the positions [token_start, token_end): their full-attention K/V
(GLM-5: MLA latents, rope keys and DSA indexer keys) and the Gated DeltaNet checkpoints at the
start of each of its shards plus the end of its last one. One process (`WHOLE`, world size 1)
holds every shard: T_r = T, n_r = S.

Full-attention K/V are preallocated once at their final size and filled shard by shard, so the
prefill never concatenates or copies them. Linear-attention state is checkpointed at every shard
boundary: local index i is the state at the start of shard `shards[i]`, index n_r the end of the
last one. Branches start from the FINAL linear-attention state, which every rank keeps
(`final_conv` / `final_recurrent`; on one process the last checkpoint is it). Checkpoints live
beside the model and are reported by `checkpoint_bytes`.
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


def rank_shard_ranges(num_shards: int, world_size: int) -> tuple[range, ...]:
    """The prefill shards each rank owns: contiguous, balanced, in rank order (one process
    owns every shard, none for a one-token prompt)."""
    if num_shards < world_size and world_size > 1:
        raise ValueError(
            f"{num_shards} prefill shards cannot be split over {world_size} ranks; use a smaller "
            "shard_tokens or fewer ranks (every rank must own at least one shard)"
        )
    base, extra = divmod(num_shards, world_size)
    ranges, start = [], 0
    for rank in range(world_size):
        count = base + (1 if rank < extra else 0)
        ranges.append(range(start, start + count))
        start += count
    return tuple(ranges)


@dataclass(frozen=True)
class Placement:
    """Rank `rank` of a sequence group of `world_size` ranks that share each prompt's state."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.world_size} ranks")

    def shards(self, num_shards: int) -> range:
        """The global indices of the prefill shards this rank owns."""
        return rank_shard_ranges(num_shards, self.world_size)[self.rank]

    def owner_of(self, shard: int, num_shards: int) -> int:
        """The rank that owns prefill shard `shard`."""
        ranges = rank_shard_ranges(num_shards, self.world_size)
        return next(r for r, owned in enumerate(ranges) if shard in owned)


WHOLE = Placement()
"""One process holds the whole state (world size 1)."""


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
    """Per-layer state of a prompt's first P - 1 tokens, computed once without autograd: the
    part of it that `placement` puts on this process (see the module docstring)."""

    spec: StateSpec
    prompt_ids: torch.Tensor
    """[P] int64 prompt tokens: the reverse sweep recomputes shards from them (8 bytes/token)."""
    shard_tokens: int
    bounds: tuple[tuple[int, int], ...]
    """Global [start, end) of every prefill shard."""
    keys: torch.Tensor | None
    """[L, T_r, K, D] full-attention keys after RoPE and k-norm, model dtype."""
    values: torch.Tensor | None
    """[L, T_r, K, Dv] full-attention values, model dtype."""
    conv: torch.Tensor | None
    """[L, n_r + 1, C, W] conv tails at the start of every owned shard and the end of the last,
    model dtype."""
    recurrent: torch.Tensor | None
    """[L, n_r + 1, H, Dk, Dv] Gated DeltaNet recurrent state, fp32, indexed like `conv`."""
    latent: torch.Tensor | None = None
    """[L, T_r, R] MLA latent after `kv_a_layernorm` (GLM-5), model dtype; nothing decompressed."""
    rope_key: torch.Tensor | None = None
    """[L, T_r, E] MLA shared rope key after RoPE, model dtype."""
    indexer_key: torch.Tensor | None = None
    """[L_idx, T_r, Di] DSA indexer keys of the layers with their own indexer, model dtype."""
    tiers: object | None = None
    """The `longstraw.engine.state_tiers.TieredState` streaming this state (each rank streams
    its own part); None: resident."""
    placement: Placement = WHOLE
    final_conv: torch.Tensor | None = None
    """[L, C, W] the conv tails after the whole prompt, kept on every rank of a group; None: the
    last checkpoint is the final state (one process)."""
    final_recurrent: torch.Tensor | None = None
    """[L, H, Dk, Dv] fp32, as `final_conv`."""

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

    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    @property
    def shards(self) -> range:
        """Global indices of the shards this process holds."""
        return self.placement.shards(self.num_shards)

    @property
    def token_start(self) -> int:
        """The first position this process holds (0 on one process)."""
        shards = self.shards
        return self.bounds[shards[0]][0] if shards else 0

    @property
    def token_end(self) -> int:
        shards = self.shards
        return self.bounds[shards[-1]][1] if shards else 0

    def owner_of(self, shard: int) -> int:
        """The rank that holds prefill shard `shard`."""
        return self.placement.owner_of(shard, self.num_shards)

    def local_checkpoint(self, shard: int) -> int:
        """The index in `conv` / `recurrent` of the checkpoint at the start of global `shard`
        (one past the last owned shard: the end of it)."""
        return shard - self.shards[0]

    def local_prefix_end(self, shard: int) -> int:
        """How many of this process's positions shard `shard`'s queries see: all before it
        (on one process: the shard's start)."""
        start = self.bounds[shard][0]
        return max(0, min(start, self.token_end) - self.token_start)

    def local_rows(self, start: int, end: int) -> slice:
        """The rows of the per-token arrays that hold global positions [start, end)."""
        return slice(start - self.token_start, end - self.token_start)

    @classmethod
    def allocate(
        cls,
        spec: StateSpec,
        *,
        prompt_ids: torch.Tensor,
        shard_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        placement: Placement = WHOLE,
    ) -> PrefixState:
        """The zero state of this process's part of the prompt (`placement`)."""
        bounds = shard_bounds(prompt_ids.numel() - 1, shard_tokens)
        shards = placement.shards(len(bounds))
        arrays = allocate_state_arrays(
            spec,
            num_tokens=bounds[shards[-1]][1] - bounds[shards[0]][0] if shards else 0,
            num_checkpoints=len(shards) + 1,
            dtype=dtype,
            device=device,
        )
        finals = {}
        if placement.world_size > 1:
            conv, recurrent = arrays["conv"], arrays["recurrent"]
            finals = {
                "final_conv": None if conv is None else torch.zeros_like(conv[:, 0]),
                "final_recurrent": None if recurrent is None else torch.zeros_like(recurrent[:, 0]),
            }
        return cls(
            spec, prompt_ids.cpu(), shard_tokens, bounds, placement=placement, **arrays, **finals
        )

    def final_linear_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([C, W], [H, Dk, Dv]) Gated DeltaNet layer `slot`'s state after the whole prompt."""
        conv, recurrent = self.final_linear_state_all()
        return conv[slot], recurrent[slot]

    def final_linear_state_all(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([L, C, W], [L, H, Dk, Dv]) every Gated DeltaNet layer's state after the prompt
        ((None, None) without such layers)."""
        if self.final_conv is not None:
            return self.final_conv, self.final_recurrent
        if self.conv is None:
            return None, None
        return self.conv[:, -1], self.recurrent[:, -1]

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

    def state_bytes(self) -> int:
        """Bytes of this process's per-token part (K/V, MLA latents): what grows with the
        prompt."""
        return nbytes(getattr(self, a.field) for a in TOKEN_ARRAYS)

    def checkpoint_bytes(self) -> int:
        """Bytes of the linear-attention checkpoints and the final state kept beside them."""
        checkpoints = [getattr(self, a.field) for a in CHECKPOINT_ARRAYS]
        return nbytes([*checkpoints, self.final_conv, self.final_recurrent])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state's arrays by storage name (docs/design.md, "Storage")."""
        return named_arrays(self)
