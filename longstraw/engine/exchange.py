"""How a branch reads the prompt prefix: the one seam between one process and several ranks.

A prompt state (`PrefixState`) is whole on this process (its placement: world size 1) or split
over the ranks of a sequence group (each rank holds its part). What a group's
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
  linear-attention state's gradient;
- `decoding_cache` and `check_draws`: the cache a sampler decodes on (rows keep their own K/V)
  and the check, after every draw, that all ranks drew the same tokens;
- `on_leader`: a call with side effects (a user's environment) made once, on the group's first
  rank, and its result handed to every rank;
- the reverse sweep's parts (`engine.sweep`): the cache layers a shard is recomputed with on the
  rank that holds it, whether its decoder layers may recompute in backward, serving a shard
  held elsewhere, and handing a shard's start-state cotangent back to the previous owner.

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

    def branch_kind_kwargs(self, state, *, keep_branch: bool, branch_capacity: int) -> dict:
        """Per layer kind field, extra arguments of its `branch_layer` (`engine.replay`)."""
        del state
        attention = {"keep_branch": keep_branch, "branch_capacity": branch_capacity}
        return {"full_attention": attention, "mla": attention}

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
            model, state, response_ids, temperature=temperature, cotangent=cotangent,
            exchange=self,
        )  # fmt: skip

        def hand_back() -> None:
            if cotangent is not None:
                branch.add_leaf_grads_into(cotangent)

        return logp, hand_back

    def decoding_cache(self, state, *, batch_size: int, branch_capacity: int):
        """A `StateCache` of `batch_size` rows whose attention layers keep the rows' own K/V
        between forwards (buffers for `branch_capacity` tokens where the layers take one)."""
        from longstraw.engine.replay import branch_cache

        return branch_cache(
            state, keep_branch=True, batch_size=batch_size, branch_capacity=branch_capacity,
            exchange=self,
        ).cache  # fmt: skip

    def check_draws(self, choice_G1: torch.Tensor, step: int) -> None:
        """Called with every decode step's draws [G, 1] before they are used."""
        del choice_G1, step

    @property
    def is_leader(self) -> bool:
        """Whether this process makes the calls `on_leader` runs."""
        return True

    def on_leader(self, call: Callable[[], object]) -> object:
        """`call()` made once (here), its result returned; `call` must not raise (return the
        error instead) so that every rank goes on the same way."""
        return call()

    def gradient_sink(self, model: PreTrainedModel):
        """Where a group's gradient accumulates (`engine.group.GradientSink`): one fp32 buffer of
        the whole gradient, which replay and sweep both drain `.grad` into."""
        from longstraw.engine.group import GradientSink, grads_drained_into, trainable_parameters
        from longstraw.grpo.grad_buffer import GradBuffer

        params, buffer = trainable_parameters(model), GradBuffer(model)
        return GradientSink(
            buffer,
            replay=grads_drained_into(params, buffer),
            sweep=grads_drained_into(params, buffer),
        )

    def busiest(self, figures: list[int]) -> list[int]:
        """Per figure (peak bytes, bytes moved), its largest value over the processes that hold
        the state: here, this one's."""
        return list(figures)

    def summed(self, counts: list[int]) -> list[int]:
        """Per count (shards computed, shards read back), its sum over the processes that hold
        the state: here, this one's."""
        return list(counts)

    def barrier(self) -> None:
        """Wait until every process that holds the state is here (one process: it is)."""

    def placement(self):
        """Which part of a prompt state this process holds (`engine.state.Placement`)."""
        from longstraw.engine.state import WHOLE

        return WHOLE

    def owner_kind_kwargs(self, state, shard: int) -> dict | None:
        """Per layer kind field, extra arguments of its `prefill_layer` / `sweep_layer` for
        computing or recomputing `shard` where it is held (None: the defaults, LongStraw's
        prefix attention over this process's state)."""
        del state, shard
        return None

    def hand_over_start_state(self, state, shard: int) -> None:
        """`shard` starts its owner's range: its start state is the previous owner's end state."""
        raise AssertionError(f"shard {shard} starts another rank's range, but there is one process")

    def share_final_state(self, state) -> None:
        """After the last shard: the final linear-attention state (one process: its last
        checkpoint already)."""
        del state

    def recomputed_layers(self, model: PreTrainedModel) -> contextlib.AbstractContextManager:
        """Around a sweep shard's forward: each decoder layer keeps only its input and
        recomputes in backward (`engine.sweep.layerwise_recompute`), so the shard's graph holds
        one layer's activations at a time."""
        from longstraw.engine import sweep

        return sweep.layerwise_recompute(model)

    def shard_name(self, state, shard: int) -> str:
        """How errors name shard `shard`."""
        del state
        return f"shard {shard}"

    def finish_owned_shard(self, state) -> None:
        """After this process computed or swept a shard it holds (the ranks: release the
        servers)."""
        del state

    def serve_shard(self, model, state, shard: int, cotangent, on_gradient_slices) -> None:
        """Answer the prefill (`cotangent` None) or the sweep of `shard`, held by another
        rank."""
        raise AssertionError(f"shard {shard} is held by another rank, but there is one process")

    def hand_back_start_cotangent(self, state, cotangent, shard: int) -> None:
        """`shard` starts its owner's range: its start-state cotangent is the end-state
        cotangent of the previous owner's last shard."""
        raise AssertionError(f"shard {shard} starts another rank's range, but there is one process")


LOCAL = PrefixExchange()
