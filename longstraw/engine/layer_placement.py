"""Each layer kind's cache layer at a placement: what a branch, a segment or a shard's forward
reads the prompt prefix through.

Every kind declares its arrays and cache layers once (`engine.layer_kinds`); a placement only
adds arguments. One process: LongStraw's prefix attention over this process's state and the
kinds' default layers. On a sequence group
(`longstraw.distributed.layer_placement.CrossRankLayers`): the cross-rank attention and each
attention kind's cross-rank layer with its process group.
"""

from __future__ import annotations

import contextlib

from transformers import PreTrainedModel

from longstraw.engine.attention import prefix_attention_enabled


class LayerPlacement:
    """The whole prompt state is on this process."""

    def attention_enabled(self, model: PreTrainedModel) -> contextlib.AbstractContextManager:
        """The attention function the model's layers run inside the block."""
        return prefix_attention_enabled(model)

    def branch_kwargs(self, state, *, keep_branch: bool, branch_capacity: int) -> dict:
        """Per layer kind field, extra arguments of its `branch_layer` (`engine.replay`)."""
        del state
        attention = {"keep_branch": keep_branch, "branch_capacity": branch_capacity}
        return {"full_attention": attention, "mla": attention}

    def segment_kwargs(self, state) -> dict | None:
        """Per layer kind field, extra arguments of its `segment_layer` (None: the defaults)."""
        del state
        return None

    def owner_kwargs(self, state, shard: int) -> dict | None:
        """Per layer kind field, extra arguments of its `prefill_layer` / `sweep_layer` for
        computing or recomputing `shard` where it is held (None: the defaults)."""
        del state, shard
        return None


WHOLE_STATE_LAYERS = LayerPlacement()
