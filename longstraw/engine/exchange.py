"""How a process reaches the prompt prefix: the one seam between one process and several ranks.

A prompt state (`PrefixState`) is whole on this process (its placement: world size 1) or split
over the ranks of a sequence group (each rank holds its part). What a group's branches do with
it — prefill, replay a response, replay a long one segment by segment or as a prefix tree of
shared turns, sample, sweep — is written once, in `engine`. Only reaching the parts held
elsewhere differs, and a `PrefixExchange` says how, in four parts:

- `layers` (`engine.layer_placement`): each layer kind's cache layer and the attention function
  the model runs at this placement;
- `shards` (`engine.shard_ownership`): which prefill shards this process holds, serving and
  handing over the others in prefill and the reverse sweep;
- `collectives` (`engine.collectives`): what the processes holding the state agree on (the
  busiest one's figures, summed counts, one leader, identical draws);
- `gradient_sink` (`engine.gradient_sink`): where a group's parameter gradients accumulate.

`LOCAL` is world size 1; `longstraw.distributed.exchange.CrossRankExchange(group)` is the ranks'.
The caller that knows the state's placement picks one, once, and hands it down.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedModel

from longstraw.engine.collectives import ONE_PROCESS, Collectives
from longstraw.engine.gradient_sink import GradientSink, whole_gradient
from longstraw.engine.layer_placement import WHOLE_STATE_LAYERS, LayerPlacement
from longstraw.engine.shard_ownership import ALL_SHARDS_HERE, ShardOwnership


@dataclass(frozen=True)
class PrefixExchange:
    """A placement's ways of reaching the prompt state (default: all of it on this process)."""

    layers: LayerPlacement = WHOLE_STATE_LAYERS
    shards: ShardOwnership = ALL_SHARDS_HERE
    collectives: Collectives = ONE_PROCESS
    gradient_sink: Callable[[PreTrainedModel], GradientSink] = whole_gradient
    """`gradient_sink(model)`: a fresh accumulator of this process's part of the gradient."""


LOCAL = PrefixExchange()
