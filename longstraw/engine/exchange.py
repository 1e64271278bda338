"""How a branch reads the prompt prefix: the one seam between one process and several ranks.

A prompt state is whole on this process (`PrefixState`, world size 1) or split over the ranks of
a sequence group (`longstraw.distributed.sharded_state.ShardedPrefixState`). What a group's
branches do with it — replay a response, replay a long one segment by segment, replay the
responses as a prefix tree of their shared turns — is written once, in `engine.group`,
`engine.segmented_replay` and `engine.branch_tree`. Only the reading of the prefix differs, and a
`PrefixExchange` supplies it:

- `attention_enabled(model)`: the attention function the model's layers run — LongStraw's prefix
  attention over this process's K/V, or the cross-rank one (every rank's partial over its
  positions all-gathered, the queries' gradient all-reduced);
- `segment_kind_kwargs`: each layer kind's cache-layer class for a long branch's segments and
  the arguments only that placement has (its process group), for `layer_kinds.segment_layers`;
- `replay_branch`: one whole response's log-probs and the hand-back of its forked
  linear-attention state's gradient.

`LOCAL` is world size 1; `longstraw.distributed.exchange.CrossRankExchange(group)` is the ranks'
(replicated: every rank runs the same branch). The caller that knows the state's placement picks
one, once, and hands it down.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from longstraw.engine.attention import prefix_attention_enabled


class PrefixExchange:
    """The whole prompt state is on this process (world size 1)."""

    def attention_enabled(self, model: PreTrainedModel) -> contextlib.AbstractContextManager:
        return prefix_attention_enabled(model)

    def segment_kind_kwargs(self, state) -> dict | None:
        """Per layer kind field, extra arguments of its `segment_layer` (None: the defaults)."""
        del state
        return None

    def replay_branch(
        self,
        model: PreTrainedModel,
        state,
        response_ids: torch.Tensor,
        *,
        temperature: float,
        cotangent,
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """(log-probs [R] with autograd, a function to call after the backward that adds the
        gradient of the forked linear-attention state into `cotangent`; exact mode)."""
        from longstraw.engine.replay import replay_branch

        logp, branch = replay_branch(
            model, state, response_ids, temperature=temperature, cotangent=cotangent
        )

        def hand_back() -> None:
            if cotangent is not None:
                branch.add_leaf_grads_into(cotangent, state)

        return logp, hand_back


LOCAL = PrefixExchange()
