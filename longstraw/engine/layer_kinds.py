"""One object per layer kind: the state it keeps and the cache layers it runs with.

Legend: L layers of the kind, T state tokens (this rank's, for a sharded state), N checkpoints
(shards + 1), K kv heads, D / Dv key / value head dims, C conv channels, W conv tail, H value
heads, Dk / Dv delta-rule key / value dims, R latent rank, E rope dim, Di indexer dim.

Users of these objects, single process and sequence-sharded alike:
- `allocate`: `engine.state.PrefixState` (a whole state or a rank's part);
- `prefill_layer`: `engine.prefill`, `distributed.layer_placement.owner_prefill_cache`;
- `branch_layer`: `engine.replay.branch_cache` (one process or a rank);
- `sweep_layer`: `engine.sweep` (on the ranks: the shard's owner, `layer_placement.owner_kwargs`);
- `segment_layer`: `engine.segmented_replay` and `engine.branch_tree`, on either placement
  (`engine.exchange` says how the prompt's part held by other ranks is read).

The cross-rank side passes its layer class (`distributed` sits above this package and cannot be
imported here) and the arguments only it has, through `kind_kwargs`. A new kind of layer is one
new class here, added to `LAYER_KINDS`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from longstraw.engine.cache import (
    ForkedLinearAttentionLayer,
    PrefixAttentionLayer,
    PrefixMlaLayer,
    SegmentMlaLayer,
    ShardStartLinearAttentionLayer,
)
from longstraw.models.adapters import StateSpec

# What a cache layer's hook hands on: (array, array slot, [rows, *X] or [*X] tensor) per array.
Record = Callable[[list[tuple["StateArray", int, torch.Tensor]]], None]


@dataclass(frozen=True)
class StateArray:
    """One array of a prompt state, declared once by its layer kind.

    Everything that iterates over a state's arrays reads these declarations: allocation, the
    exact-mode cotangent, the tiers, gathering and scattering over ranks, the storage layout and
    the Zarr manifest, and the recomputed outputs the sweep and segments check and backpropagate.
    """

    field: str
    """Attribute of `PrefixState` (and of `PromptCotangent`, with a cotangent): "keys"."""
    storage_name: str
    """Array path inside state.zarr: "full_attention/k"."""
    per_token: bool
    """True: [L, T, ...] indexed by position (grows with the prompt, streamed by the tiers);
    False: [L, N, ...] checkpoints at shard boundaries (constant per shard)."""
    has_cotangent: bool
    """Exact mode accumulates a fp32 cotangent of it (False: read under no_grad only)."""
    layers_attr: str = "layer_indices"
    """The attribute of the kind's spec listing the decoder layers that hold a slot."""

    def layer_indices(self, kind_spec: Any) -> tuple[int, ...]:
        """Decoder layer of each slot (dim 0) of this array."""
        return tuple(getattr(kind_spec, self.layers_attr))


class LayerKind(abc.ABC):
    """A kind of decoder layer, named by its field of `StateSpec`."""

    field: str
    arrays: tuple[StateArray, ...]
    """The state arrays of this kind, in the order its cache layers hand them to a hook."""

    def spec(self, state_spec: StateSpec) -> Any:
        """This kind's part of the spec, or None when the model has no such layer."""
        return getattr(state_spec, self.field)

    def slots(self, state_spec: StateSpec) -> Iterator[tuple[int, int]]:
        """(slot in this kind's arrays, decoder layer index) of each layer of this kind."""
        spec = self.spec(state_spec)
        return iter(()) if spec is None else enumerate(spec.layer_indices)

    @abc.abstractmethod
    def output_hooks(self, state_spec: StateSpec, slot: int, record: Record) -> dict[str, Any]:
        """The hook arguments of this kind's cache layer (`on_update`, or `on_conv` /
        `on_recurrent`) that hand each forward's new state of layer `slot` to
        `record([(array, array slot, tensor in the state's layout without the batch dim)])`:
        what prefill and segments write, and what the sweep checks and backpropagates."""

    @abc.abstractmethod
    def allocate(
        self, spec: Any, *, num_tokens: int, num_checkpoints: int, dtype, device
    ) -> dict[str, torch.Tensor]:
        """This kind's arrays of a prompt state (names from `STATE_ARRAYS`), for `num_tokens`
        positions and `num_checkpoints` shard-boundary checkpoints."""

    @abc.abstractmethod
    def branch_layer(
        self,
        state,
        slot: int,
        layer_idx: int,
        cotangent,
        /,
        *,
        leaves: dict,
        batch_size: int,
        **kwargs,
    ) -> Any:
        """The cache layer one branch (or `batch_size` rows) replays this layer with; forked
        leaves of the state go into `leaves[slot]` (exact mode)."""

    @abc.abstractmethod
    def prefill_layer(
        self,
        state,
        slot: int,
        layer_idx: int,
        /,
        *,
        prefix_end: int,
        rows: slice,
        checkpoint: int,
        **kwargs,
    ) -> Any:
        """The cache layer one prefill shard runs this layer with: it reads the state's first
        `prefix_end` rows and writes the shard's `rows` of the per-token arrays, or (recurrent
        kinds) starts from checkpoint `checkpoint` and writes checkpoint `checkpoint + 1`."""

    @abc.abstractmethod
    def sweep_layer(
        self,
        state,
        slot: int,
        layer_idx: int,
        cotangent,
        /,
        *,
        prefix_end: int,
        checkpoint: int,
        leaves: dict,
        **kwargs,
    ) -> Any:
        """The cache layer the reverse sweep recomputes one shard with, under autograd: it reads
        the first `prefix_end` rows and adds their cotangent into `cotangent`, or (recurrent
        kinds) starts from a leaf fork of checkpoint `checkpoint` (`leaves[slot]`). `kwargs` carry
        the caller's capture hooks (`on_update`; `on_conv` / `on_recurrent`)."""

    @abc.abstractmethod
    def segment_layer(
        self,
        prompt,
        branch,
        slot: int,
        layer_idx: int,
        k: int,
        /,
        *,
        prompt_cotangent,
        branch_cotangent,
        leaves: dict,
        on_update,
    ) -> Any:
        """The cache layer segment k of a long branch runs this layer with
        (`engine.segmented_replay`): it reads the prompt's state and the branch's own state
        before the segment (`branch`, a `PrefixState` whose shards are the segments), and hands
        the segment's new state to the `Record` `on_update` (through `output_hooks`). With `branch_cotangent` (autograd)
        the branch state it reads from a fork is a leaf (`leaves[slot]`)."""


class FullAttention(LayerKind):
    """Softmax attention: K/V per token."""

    field = "full_attention"
    arrays = (
        StateArray("keys", "full_attention/k", per_token=True, has_cotangent=True),
        StateArray("values", "full_attention/v", per_token=True, has_cotangent=True),
    )

    def output_hooks(self, state_spec, slot, record):
        keys, values = self.arrays

        def on_update(k_BKSD, v_BKSD):
            record(
                [(keys, slot, k_BKSD[0].transpose(0, 1)), (values, slot, v_BKSD[0].transpose(0, 1))]
            )

        return {"on_update": on_update}

    def allocate(self, fa, *, num_tokens, num_checkpoints, dtype, device):
        layers = len(fa.layer_indices)
        # torch.empty: every position is written by exactly one shard before it is read.
        return {
            "keys": torch.empty(
                layers, num_tokens, fa.num_kv_heads, fa.head_dim, dtype=dtype, device=device
            ),  # [L, T, K, D]
            "values": torch.empty(
                layers, num_tokens, fa.num_kv_heads, fa.value_head_dim, dtype=dtype, device=device
            ),  # [L, T, K, Dv]
        }

    def prefix_layer(
        self, state, slot, cotangent, /, *, end=None, layer_class=PrefixAttentionLayer, **kwargs
    ):
        """The cache layer reading K/V positions [0, end) of `state` (all of them: None), adding
        their cotangent into the same rows of `cotangent` (None: no cotangent)."""
        rows = slice(end)
        return layer_class(
            state.keys[slot, rows],
            state.values[slot, rows],
            grad_k_TKD=None if cotangent is None else cotangent.keys[slot, rows],
            grad_v_TKD=None if cotangent is None else cotangent.values[slot, rows],
            **kwargs,
        )

    def branch_layer(self, state, slot, layer_idx, cotangent, /, *, leaves, batch_size, **kwargs):
        del layer_idx, leaves, batch_size  # rows share the prefix K/V; nothing is forked
        return self.prefix_layer(state, slot, cotangent, **kwargs)

    def prefill_layer(self, state, slot, layer_idx, /, *, prefix_end, rows, checkpoint, **kwargs):
        del layer_idx
        writer = state_writer(state, rows, checkpoint + 1)
        hooks = self.output_hooks(state.spec, slot, writer)
        return self.prefix_layer(state, slot, None, end=prefix_end, **hooks, **kwargs)

    def sweep_layer(
        self, state, slot, layer_idx, cotangent, /, *, prefix_end, checkpoint, leaves, **kwargs
    ):
        del layer_idx, checkpoint, leaves
        return self.prefix_layer(state, slot, cotangent, end=prefix_end, **kwargs)

    def segment_layer(
        self,
        prompt,
        branch,
        slot,
        layer_idx,
        k,
        /,
        *,
        prompt_cotangent,
        branch_cotangent,
        leaves,
        on_update,
        **kwargs,
    ):
        del layer_idx, leaves  # the earlier segments' K/V cotangent goes to branch_cotangent
        a, _ = branch.bounds[k]
        grad = branch_cotangent is not None
        extra = (
            branch.keys[slot, :a],
            branch.values[slot, :a],
            branch_cotangent.keys[slot, :a] if grad else None,
            branch_cotangent.values[slot, :a] if grad else None,
        )
        hooks = self.output_hooks(prompt.spec, slot, on_update)
        return self.prefix_layer(
            prompt, slot, prompt_cotangent, extra_prefix=extra, **hooks, **kwargs
        )


class GatedDeltaNet(LayerKind):
    """Linear attention: a conv tail and a recurrent state, checkpointed at shard starts."""

    field = "linear_attention"
    arrays = (
        StateArray("conv", "linear_attention/conv", per_token=False, has_cotangent=True),
        StateArray("recurrent", "linear_attention/recurrent", per_token=False, has_cotangent=True),
    )

    def output_hooks(self, state_spec, slot, record):
        conv, recurrent = self.arrays
        return {
            "on_conv": lambda tail_BCW: record([(conv, slot, tail_BCW[0])]),
            "on_recurrent": lambda rec_BHKV: record([(recurrent, slot, rec_BHKV[0])]),
        }

    def allocate(self, la, *, num_tokens, num_checkpoints, dtype, device):
        layers = len(la.layer_indices)
        # Index 0 is the zero state a sequence starts from (what transformers uses without a cache).
        return {
            "conv": torch.zeros(
                layers, num_checkpoints, la.conv_dim, la.conv_tail, dtype=dtype, device=device
            ),  # [L, N, C, W]
            "recurrent": torch.zeros(
                layers,
                num_checkpoints,
                la.num_value_heads,
                la.key_head_dim,
                la.value_head_dim,
                dtype=torch.float32,
                device=device,
            ),  # [L, N, H, Dk, Dv] fp32
        }

    def branch_layer(self, state, slot, layer_idx, cotangent, /, *, leaves, batch_size):
        """A fork of the final state; with `cotangent`, the forked tensors are leaves whose
        gradient the caller adds to the cotangent after backward (`leaves[slot]`)."""
        conv, recurrent = state.final_linear_state(slot)
        if cotangent is not None:
            # detach() is a view: the leaf shares the state's storage, nothing is copied.
            conv = conv.detach().requires_grad_(True)
            recurrent = recurrent.detach().requires_grad_(True)
            leaves[slot] = (conv, recurrent)
        return ForkedLinearAttentionLayer(
            conv.unsqueeze(0).expand(batch_size, -1, -1),
            recurrent.unsqueeze(0).expand(batch_size, -1, -1, -1),
        )

    def prefill_layer(self, state, slot, layer_idx, /, *, prefix_end, rows, checkpoint):
        # The state is the checkpoint, whatever the shard's length.
        return ForkedLinearAttentionLayer(
            state.conv[slot, checkpoint].unsqueeze(0),
            state.recurrent[slot, checkpoint].unsqueeze(0),
            **self.output_hooks(state.spec, slot, state_writer(state, rows, checkpoint + 1)),
        )

    def sweep_layer(
        self,
        state,
        slot,
        layer_idx,
        cotangent,
        /,
        *,
        prefix_end,
        checkpoint,
        leaves,
        layer_class=ShardStartLinearAttentionLayer,
        **kwargs,
    ):
        del cotangent, prefix_end  # the caller adds the leaves' gradients after backward
        conv = state.conv[slot, checkpoint].detach().requires_grad_(True)
        recurrent = state.recurrent[slot, checkpoint].detach().requires_grad_(True)
        leaves[slot] = (conv, recurrent)
        return layer_class(conv.unsqueeze(0), recurrent.unsqueeze(0), **kwargs)

    def segment_layer(
        self,
        prompt,
        branch,
        slot,
        layer_idx,
        k,
        /,
        *,
        prompt_cotangent,
        branch_cotangent,
        leaves,
        on_update,
    ):
        del prompt_cotangent, layer_idx  # the branch starts from the prompt's end state
        conv, recurrent = branch.conv[slot, k], branch.recurrent[slot, k]
        if branch_cotangent is not None:
            conv = conv.detach().requires_grad_(True)
            recurrent = recurrent.detach().requires_grad_(True)
            leaves[slot] = (conv, recurrent)
        return ForkedLinearAttentionLayer(
            conv.unsqueeze(0),
            recurrent.unsqueeze(0),
            **self.output_hooks(prompt.spec, slot, on_update),
        )


class Mla(LayerKind):
    """Multi-head latent attention (GLM-5): latents and rope keys per token, DSA indexer keys."""

    field = "mla"
    arrays = (
        StateArray("latent", "mla/latent", per_token=True, has_cotangent=True),
        StateArray("rope_key", "mla/rope_key", per_token=True, has_cotangent=True),
        # The DSA indexer runs under no_grad: its keys are checked, never backpropagated.
        StateArray(
            "indexer_key",
            "mla/indexer_key",
            per_token=True,
            has_cotangent=False,
            layers_attr="indexer_layer_indices",
        ),
    )

    def output_hooks(self, state_spec, slot, record):
        latent, rope_key, indexer_key = self.arrays
        index_slot = indexer_slot(state_spec.mla, state_spec.mla.layer_indices[slot])

        def on_update(latent_BSR, rope_BSE, index_BSD):
            entries = [(latent, slot, latent_BSR[0]), (rope_key, slot, rope_BSE[0])]
            if index_slot is not None and index_BSD is not None:
                entries.append((indexer_key, index_slot, index_BSD[0]))
            record(entries)

        return {"on_update": on_update}

    def allocate(self, mla, *, num_tokens, num_checkpoints, dtype, device):
        layers = len(mla.layer_indices)
        return {
            "latent": torch.empty(
                layers, num_tokens, mla.kv_lora_rank, dtype=dtype, device=device
            ),  # [L, T, R]
            "rope_key": torch.empty(
                layers, num_tokens, mla.rope_dim, dtype=dtype, device=device
            ),  # [L, T, E]
            "indexer_key": torch.empty(
                len(mla.indexer_layer_indices),
                num_tokens,
                mla.index_head_dim,
                dtype=dtype,
                device=device,
            ),  # [L_idx, T, Di]
        }

    def prefix_layer(
        self, state, slot, layer_idx, cotangent, /, *, end=None, layer_class=PrefixMlaLayer, **kw
    ):
        """The cache layer reading latents, rope keys (and this layer's indexer keys) at
        positions [0, end) of `state` (all of them: None), adding the cotangent of the first two
        into the same rows of `cotangent` (None: no cotangent)."""
        rows = slice(end)
        index_slot = indexer_slot(state.spec.mla, layer_idx)
        return layer_class(
            state.latent[slot, rows],
            state.rope_key[slot, rows],
            None if index_slot is None else state.indexer_key[index_slot, rows],
            grad_latent_TR=None if cotangent is None else cotangent.latent[slot, rows],
            grad_rope_TE=None if cotangent is None else cotangent.rope_key[slot, rows],
            **kw,
        )

    def branch_layer(self, state, slot, layer_idx, cotangent, /, *, leaves, batch_size, **kwargs):
        del leaves, batch_size  # rows share the prefix latents; nothing is forked
        return self.prefix_layer(state, slot, layer_idx, cotangent, **kwargs)

    def prefill_layer(self, state, slot, layer_idx, /, *, prefix_end, rows, checkpoint, **kwargs):
        hooks = self.output_hooks(state.spec, slot, state_writer(state, rows, checkpoint + 1))
        return self.prefix_layer(state, slot, layer_idx, None, end=prefix_end, **hooks, **kwargs)

    def sweep_layer(
        self, state, slot, layer_idx, cotangent, /, *, prefix_end, checkpoint, leaves, **kwargs
    ):
        del checkpoint, leaves
        return self.prefix_layer(state, slot, layer_idx, cotangent, end=prefix_end, **kwargs)

    def segment_layer(
        self,
        prompt,
        branch,
        slot,
        layer_idx,
        k,
        /,
        *,
        prompt_cotangent,
        branch_cotangent,
        leaves,
        on_update,
        layer_class=SegmentMlaLayer,
        **kwargs,
    ):
        a, _ = branch.bounds[k]
        index_slot = indexer_slot(prompt.spec.mla, layer_idx)
        latent, rope = branch.latent[slot, :a], branch.rope_key[slot, :a]
        if branch_cotangent is not None:
            latent = latent.detach().requires_grad_(True)
            rope = rope.detach().requires_grad_(True)
            leaves[slot] = (latent, rope)
        index = None if index_slot is None else branch.indexer_key[index_slot, :a]
        return self.prefix_layer(
            prompt,
            slot,
            layer_idx,
            prompt_cotangent,
            layer_class=layer_class,
            earlier=(latent, rope, index),
            **self.output_hooks(prompt.spec, slot, on_update),
            **kwargs,
        )


def indexer_slot(mla, layer_idx: int) -> int | None:
    """The slot of decoder layer `layer_idx` in the indexer keys (None: the layer has none)."""
    return mla.indexer_slot(layer_idx) if layer_idx in mla.indexer_layer_indices else None


LAYER_KINDS: tuple[LayerKind, ...] = (FullAttention(), GatedDeltaNet(), Mla())

# Every array a prompt state may hold, in a fixed order (storage, manifests, gathers).
STATE_ARRAYS: tuple[StateArray, ...] = tuple(a for kind in LAYER_KINDS for a in kind.arrays)
TOKEN_ARRAYS = tuple(a for a in STATE_ARRAYS if a.per_token)
CHECKPOINT_ARRAYS = tuple(a for a in STATE_ARRAYS if not a.per_token)
COTANGENT_ARRAYS = tuple(a for a in STATE_ARRAYS if a.has_cotangent)
STATE_FIELDS = tuple(a.field for a in STATE_ARRAYS)
_BY_FIELD = {a.field: a for a in STATE_ARRAYS}
_BY_STORAGE_NAME = {a.storage_name: a for a in STATE_ARRAYS}
_KIND_OF = {a.field: kind for kind in LAYER_KINDS for a in kind.arrays}


def state_array_by_storage_name(name: str) -> StateArray:
    """The declaration of the state array stored at `name` ("full_attention/k", ...)."""
    return _BY_STORAGE_NAME[name]


def array_layer_indices(spec: StateSpec, field: str) -> tuple[int, ...]:
    """Decoder layer of each slot of the state array `field` for a model's `spec`."""
    return _BY_FIELD[field].layer_indices(_KIND_OF[field].spec(spec))


def named_arrays(holder) -> dict[str, torch.Tensor]:
    """The arrays a state (or a rank's slice) holds, by storage name, in `STATE_ARRAYS` order."""
    named = {a.storage_name: getattr(holder, a.field, None) for a in STATE_ARRAYS}
    return {name: tensor for name, tensor in named.items() if tensor is not None}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def allocate_state_arrays(
    spec: StateSpec, *, num_tokens: int, num_checkpoints: int, dtype, device
) -> dict[str, torch.Tensor | None]:
    """Every array of `STATE_ARRAYS` by field, allocated for the kinds the model has (None
    otherwise)."""
    arrays: dict[str, torch.Tensor | None] = dict.fromkeys(STATE_FIELDS)
    for kind in LAYER_KINDS:
        sub = kind.spec(spec)
        if sub is not None:
            arrays.update(
                kind.allocate(
                    sub,
                    num_tokens=num_tokens,
                    num_checkpoints=num_checkpoints,
                    dtype=dtype,
                    device=device,
                )
            )
    return arrays


def branch_layers(
    state, cotangent, *, leaves: dict, batch_size: int = 1, kind_kwargs: dict | None = None
) -> list:
    """[num_layers] the cache layers of one replay over `state`.

    `leaves` receives the forked linear-attention state by slot (exact mode); `kind_kwargs`
    maps a kind's field to extra arguments of its `branch_layer` (a cross-rank layer class, its
    process group, decoding buffers).
    """
    layers: list = [None] * state.spec.num_layers
    for kind in LAYER_KINDS:
        for slot, layer_idx in kind.slots(state.spec):
            layers[layer_idx] = kind.branch_layer(
                state,
                slot,
                layer_idx,
                cotangent,
                leaves=leaves,
                batch_size=batch_size,
                **_extra(kind_kwargs, kind, slot),
            )
    return layers


def prefill_layers(
    state, *, prefix_end: int, rows: slice, checkpoint: int, kind_kwargs: dict | None = None
) -> list:
    """[num_layers] the cache layers one prefill shard runs with (`LayerKind.prefill_layer`).

    Single process: `prefix_end` = the shard's start, `rows` its positions, `checkpoint` its
    index; a rank of a sharded state gives the same in its local rows and checkpoints.
    """
    layers: list = [None] * state.spec.num_layers
    for kind in LAYER_KINDS:
        for slot, layer_idx in kind.slots(state.spec):
            layers[layer_idx] = kind.prefill_layer(
                state,
                slot,
                layer_idx,
                prefix_end=prefix_end,
                rows=rows,
                checkpoint=checkpoint,
                **_extra(kind_kwargs, kind, slot),
            )
    return layers


def sweep_layers(
    state,
    cotangent,
    *,
    prefix_end: int,
    checkpoint: int,
    leaves: dict,
    record: Record,
    kind_kwargs: dict | None = None,
) -> list:
    """[num_layers] the cache layers the reverse sweep recomputes one shard with
    (`LayerKind.sweep_layer`), handing the shard's new state to `record`; `kind_kwargs` as in
    `branch_layers` (a cross-rank layer class and its process group)."""
    layers: list = [None] * state.spec.num_layers
    for kind in LAYER_KINDS:
        for slot, layer_idx in kind.slots(state.spec):
            layers[layer_idx] = kind.sweep_layer(
                state,
                slot,
                layer_idx,
                cotangent,
                prefix_end=prefix_end,
                checkpoint=checkpoint,
                leaves=leaves,
                **kind.output_hooks(state.spec, slot, record),
                **_extra(kind_kwargs, kind, slot),
            )
    return layers


def segment_layers(
    prompt,
    branch,
    k: int,
    *,
    prompt_cotangent,
    branch_cotangent,
    leaves: dict,
    on_update: Record,
    kind_kwargs: dict | None = None,
) -> list:
    """[num_layers] the cache layers segment k of a long branch runs with
    (`LayerKind.segment_layer`); `leaves` receives each kind's leaves by its field and slot;
    `kind_kwargs` as in `branch_layers` (a sharded prompt's cross-rank layer class)."""
    layers: list = [None] * prompt.spec.num_layers
    for kind in LAYER_KINDS:
        for slot, layer_idx in kind.slots(prompt.spec):
            layers[layer_idx] = kind.segment_layer(
                prompt,
                branch,
                slot,
                layer_idx,
                k,
                prompt_cotangent=prompt_cotangent,
                branch_cotangent=branch_cotangent,
                leaves=leaves.setdefault(kind.field, {}),
                on_update=on_update,
                **_extra(kind_kwargs, kind, slot),
            )
    return layers


def state_writer(state, rows: slice, checkpoint: int) -> Record:
    """A `Record` that stores a span's new state into `state`: per-token arrays at positions
    `rows`, checkpoint arrays at entry `checkpoint` (prefill shards, branch segments)."""

    def write(entries: list[tuple[StateArray, int, torch.Tensor]]) -> None:
        for array, slot, tensor in entries:
            target = getattr(state, array.field)
            if array.per_token:
                target[slot, rows] = tensor
            else:
                target[slot, checkpoint] = tensor

    return write


def _extra(kind_kwargs: dict | None, kind: LayerKind, slot: int) -> dict:
    """A kind's extra layer arguments: a dict, or a function of the slot giving one."""
    extra = (kind_kwargs or {}).get(kind.field, {})
    return extra(slot) if callable(extra) else extra
