"""Cache objects that let an unmodified transformers model read and write LongStraw's prompt state.

transformers' own cache layers append with `torch.cat` (a P-sized copy per layer per branch) and
write linear-attention state in place with `.copy_` (which corrupts the prompt state under
autograd; see docs/design.md). These layers never do either: full-attention layers hand the model only
the new tokens' K/V and keep a *view* of the prefix for the attention function; linear-attention
layers rebind their conv tail and recurrent state to new tensors instead of writing into them.

What happens to the new tokens' state is a callback (`on_update`): prefill writes it into the
preallocated state, the exact sweep captures it for its backward, replay ignores it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from longstraw.ops.mla_attention import LatentRanks
from longstraw.ops.prefix_attention import PrefixRanks


class BranchBuffer:
    """Decoding's record of the rows' own state along `dim`: preallocated, appended in place.

    `append(x)` writes `x` after what is kept and returns a view of everything kept so far, so a
    decoding step allocates nothing (until `capacity` is passed; then the buffer doubles, and
    views handed out earlier keep reading the old storage, whose first entries are unchanged).
    Decoding runs without autograd; the in-place writes would break a graph.
    """

    def __init__(self, dim: int, capacity: int = 0):
        self.dim = dim
        self.capacity = capacity
        self.length = 0
        self.data: torch.Tensor | None = None

    def append(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("BranchBuffer keeps decoding state in place: run under no_grad")
        end = self.length + x.shape[self.dim]
        if self.data is None or end > self.data.shape[self.dim]:
            size = 0 if self.data is None else self.data.shape[self.dim]
            shape = list(x.shape)
            shape[self.dim] = max(end, self.capacity, 2 * size)
            grown = x.new_empty(shape)
            if self.length:
                grown.narrow(self.dim, 0, self.length).copy_(self.view())
            self.data = grown
        self.data.narrow(self.dim, self.length, x.shape[self.dim]).copy_(x)
        self.length = end
        return self.view()

    def view(self) -> torch.Tensor | None:
        return None if self.data is None else self.data.narrow(self.dim, 0, self.length)


class PrefixAttentionLayer:
    """One full-attention layer: a read-only prefix (views into the state) + this forward's K/V.

    `ranks` (`longstraw.ops.prefix_attention.PrefixRanks`): the prefix is this rank's part of a
    prompt split over a sequence group, the rest read through it (None: the whole prefix is
    here). Decoding (`keep_branch`) and a long branch's earlier segments (`extra_prefix`) run
    replicated: every rank runs the same forward.
    """

    is_linear = False
    is_sliding = False

    def __init__(
        self,
        prefix_k_TKD: torch.Tensor,
        prefix_v_TKD: torch.Tensor,
        *,
        grad_k_TKD: torch.Tensor | None = None,
        grad_v_TKD: torch.Tensor | None = None,
        on_update: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        keep_branch: bool = False,
        branch_capacity: int = 0,
        extra_prefix: tuple | None = None,
        ranks: PrefixRanks | None = None,
    ):
        if ranks is not None and not ranks.replicated and (keep_branch or extra_prefix is not None):
            raise ValueError(
                "decoding and a branch's earlier segments run replicated on the ranks: pass "
                "replicated ranks"
            )
        self.ranks = ranks
        self.prefix_k_TKD = prefix_k_TKD
        self.prefix_v_TKD = prefix_v_TKD
        # fp32 cotangent buffers the attention backward adds dK/dV of the prefix into (exact mode).
        self.grad_k_TKD = grad_k_TKD
        self.grad_v_TKD = grad_v_TKD
        self.on_update = on_update
        # Decoding keeps the branch's own K/V between steps (a small overlay, never the prefix),
        # in buffers preallocated for `branch_capacity` tokens.
        self.keep_branch = keep_branch
        self.branch_k = BranchBuffer(2, branch_capacity)
        self.branch_v = BranchBuffer(2, branch_capacity)
        # A long branch's earlier segments (engine/segmented_replay.py), read as a second prefix
        # after the prompt's: (k [a, K, D], v [a, K, Dv], grad_k | None, grad_v | None) of
        # branch positions < a; None outside segmented replay.
        self.extra_prefix = extra_prefix

    def update(
        self, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.on_update is not None:
            self.on_update(k_BKSD, v_BKSD)
        if not self.keep_branch:
            return k_BKSD, v_BKSD
        return self.branch_k.append(k_BKSD), self.branch_v.append(v_BKSD)

    def branch_length(self) -> int:
        return self.branch_k.length


class ForkedLinearAttentionLayer:
    """One Gated DeltaNet layer whose state is rebound, never written: a fork of the prompt state."""

    is_linear = True
    is_sliding = False

    def __init__(
        self,
        conv_tail_BCW: torch.Tensor,
        recurrent_BHKV: torch.Tensor,
        *,
        on_conv: Callable[[torch.Tensor], None] | None = None,
        on_recurrent: Callable[[torch.Tensor], None] | None = None,
    ):
        self.conv_tail_BCW = conv_tail_BCW
        self.recurrent_BHKV = recurrent_BHKV
        self.on_conv = on_conv
        self.on_recurrent = on_recurrent

    def _with_tail(self, x_BCS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([tail ; x], the new tail: the last W inputs of that)."""
        tail = self.conv_tail_BCW.to(x_BCS.dtype).expand(x_BCS.shape[0], -1, -1)
        full_BCX = torch.cat([tail, x_BCS], dim=-1)
        width = self.conv_tail_BCW.shape[-1]
        # A copy, not a view: a view would keep the whole [B, C, W + S] input alive as long as
        # the tail lives (in the sweep, until the shard's backward; in decoding, all branch long).
        return full_BCX, full_BCX[..., full_BCX.shape[-1] - width :].clone()

    def update_conv_state(self, x_BCS: torch.Tensor) -> torch.Tensor:
        """Return [tail ; x] so the model's causal conv sees its left context; rebind the tail."""
        full_BCX, self.conv_tail_BCW = self._with_tail(x_BCS)
        if self.on_conv is not None:
            self.on_conv(self.conv_tail_BCW)
        return full_BCX

    def update_recurrent_state(self, recurrent_BHKV: torch.Tensor) -> torch.Tensor:
        self.recurrent_BHKV = recurrent_BHKV
        if self.on_recurrent is not None:
            self.on_recurrent(recurrent_BHKV)
        return recurrent_BHKV


class ShardStartLinearAttentionLayer(ForkedLinearAttentionLayer):
    """A Gated DeltaNet layer that starts every forward from the same (shard-start) state.

    The exact sweep recomputes each decoder layer during backward (activation checkpointing);
    the recomputation must see the inputs the first forward saw, so this layer reports the end
    state through its callbacks but never rebinds its own.
    """

    def update_conv_state(self, x_BCS: torch.Tensor) -> torch.Tensor:
        full_BCX, tail_BCW = self._with_tail(x_BCS)
        if self.on_conv is not None:
            self.on_conv(tail_BCW)
        return full_BCX

    def update_recurrent_state(self, recurrent_BHKV: torch.Tensor) -> torch.Tensor:
        if self.on_recurrent is not None:
            self.on_recurrent(recurrent_BHKV)
        return recurrent_BHKV


class PrefixMlaLayer:
    """One MLA layer (GLM-5): read-only prefix latents (views into the state) + this forward's own.

    Read by `longstraw.models.glm`'s attention forward, which replaces transformers' (that one
    re-expands every cached latent into per-head K/V). `on_update(latent_BSR, rope_BSE,
    index_key_BSD | None)` sees each forward's new state, like `PrefixAttentionLayer.on_update`.
    `ranks` (`longstraw.ops.mla_attention.LatentRanks`) as `PrefixAttentionLayer`'s: the prefix
    is this rank's part of a prompt split over a sequence group (None: all of it).
    """

    is_linear = False
    is_sliding = False

    def __init__(
        self,
        prefix_latent_TR: torch.Tensor,
        prefix_rope_TE: torch.Tensor,
        prefix_index_TD: torch.Tensor | None,
        *,
        grad_latent_TR: torch.Tensor | None = None,
        grad_rope_TE: torch.Tensor | None = None,
        on_update: Callable[..., None] | None = None,
        keep_branch: bool = False,
        branch_capacity: int = 0,
        ranks: LatentRanks | None = None,
    ):
        if ranks is not None and not ranks.replicated and keep_branch:
            raise ValueError("decoding runs replicated on the ranks: pass replicated ranks")
        self.ranks = ranks
        self.prefix_latent_TR = prefix_latent_TR
        self.prefix_rope_TE = prefix_rope_TE
        # None on `shared` indexer layers, which reuse the previous layer's selection.
        self.prefix_index_TD = prefix_index_TD
        # fp32 cotangent buffers the latent attention's backward adds into (exact mode). The
        # indexer key has none: transformers runs the indexer under no_grad.
        self.grad_latent_TR = grad_latent_TR
        self.grad_rope_TE = grad_rope_TE
        self.on_update = on_update
        self.keep_branch = keep_branch
        # Decoding's kept latents, rope keys and indexer keys ([B, X, *], appended along X).
        self.branch = tuple(BranchBuffer(1, branch_capacity) for _ in range(3))

    def update(
        self,
        latent_BSR: torch.Tensor,
        rope_BSE: torch.Tensor,
        index_key_BSD: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Return the branch's latents so far ([B, X, *]: this forward's, or the kept overlay + them)."""
        if self.on_update is not None:
            self.on_update(latent_BSR, rope_BSE, index_key_BSD)
        new = (latent_BSR, rope_BSE, index_key_BSD)
        if not self.keep_branch:
            return new
        return tuple(
            None if cur is None else kept.append(cur)
            for kept, cur in zip(self.branch, new, strict=True)
        )

    def branch_length(self) -> int:
        return self.branch[0].length


class SegmentMlaLayer(PrefixMlaLayer):
    """An MLA layer whose branch part starts with the branch's earlier segments: `update` returns
    [earlier ; this forward's] latents, rope keys and indexer keys, so GLM's forward sees the
    earlier positions as causal branch keys (queries sit at the last S of the X positions)."""

    def __init__(self, *args, earlier, **kwargs):
        super().__init__(*args, **kwargs)
        self.earlier = earlier
        """(latent [a, R], rope [a, E], index key [a, Di] | None) of branch positions < a."""

    def update(self, latent_BSR, rope_BSE, index_key_BSD):
        if self.on_update is not None:
            self.on_update(latent_BSR, rope_BSE, index_key_BSD)
        new = (latent_BSR, rope_BSE, index_key_BSD)
        return tuple(
            None if cur is None else torch.cat([old.to(cur.dtype).unsqueeze(0), cur], dim=1)
            for old, cur in zip(self.earlier, new, strict=True)
        )


class StateCache(Cache):
    """A transformers `Cache` over LongStraw layers, passed to the model as `cache=`.

    `position_offset` is where this forward's tokens start; the engine always passes explicit
    `position_ids`, so it only answers `get_seq_length` for code that asks.
    """

    def __init__(self, layers: list, *, position_offset: int):
        super().__init__(layers=layers)
        self.position_offset = position_offset

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.layers[layer_idx].conv_tail_BCW

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, **kwargs):
        return self.layers[layer_idx].update_conv_state(conv_states)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.layers[layer_idx].recurrent_BHKV

    def update_recurrent_state(
        self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs
    ):
        return self.layers[layer_idx].update_recurrent_state(recurrent_states)

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        # True keeps Gated DeltaNet off its 1-token `causal_conv1d_update`, which writes the conv
        # state in place; every length then goes through `update_conv_state`, which rebinds.
        return True

    def has_previous_state(
        self, layer_idx: int | None = None, state_idx: int | None = None
    ) -> bool:
        return True

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.position_offset

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.position_offset + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.position_offset
