"""torch.distributed pieces: sequence-sharded prompt state, cross-rank attention, reduction.

The engine (`longstraw.engine`) runs at every world size; what a rank adds is its
`PrefixExchange`, `longstraw.distributed.exchange.CrossRankExchange(group)`, handed to
`engine.prefill.prefill`, `engine.replay.replay_branch`, `engine.rollout.sample_responses` and
`engine.group.group_gradient`. Its attention layers run the engine's one attention op per
kind, given the ranks that hold the rest of the prompt: K/V (`cross_rank_attention.KvRanks`),
GLM-5's MLA latents with a global DSA top-k (`cross_rank_mla.LatentRanks`); Gated DeltaNet
state is handed over at ownership boundaries (`shard_ownership`).

See docs/scaling.md. Here: `run_on_ranks` (launch), `wavefront_prefill` (the same state on a
layer wavefront: all ranks compute at once), fp32 gradient accumulators sharded over the
sequence group (`GradSlices`, `longstraw.distributed.gradient_slices`), `scatter_state` /
`gather_state`; FSDP2 over a ("data", "seq") mesh in `longstraw.distributed.fsdp`.
"""

from longstraw.distributed.collectives import ReplicaDivergenceError
from longstraw.distributed.exchange import CrossRankExchange
from longstraw.distributed.gradient_slices import GradSlices, SliceLayout
from longstraw.distributed.launch import RankFailedError, run_on_ranks
from longstraw.distributed.sharded_state import gather_state, scatter_state
from longstraw.distributed.wavefront_prefill import wavefront_prefill

__all__ = [
    "CrossRankExchange",
    "GradSlices",
    "RankFailedError",
    "ReplicaDivergenceError",
    "SliceLayout",
    "gather_state",
    "run_on_ranks",
    "scatter_state",
    "wavefront_prefill",
]
