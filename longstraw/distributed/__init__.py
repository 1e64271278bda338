"""torch.distributed pieces: sequence-sharded prompt state, cross-rank attention, reduction.

Families: K/V (full attention) and Gated DeltaNet layers (`cross_rank_attention`), GLM-5's MLA
latents with a global DSA top-k (`cross_rank_mla`).

See docs/scaling.md. Entry points: `run_on_ranks` (launch), `sharded_prefill`,
`wavefront_prefill` (the same
state on a layer wavefront: all ranks compute at once), `sharded_sample_responses`
(rollout over the sharded prefix), `sharded_branch_logprobs`,
`sharded_group_gradients`, `all_reduce_rank_gradients`,
`sharded_group_gradient_slices` (fp32 accumulators sharded over the sequence group,
`longstraw.distributed.gradient_slices`), `scatter_state` / `gather_state`; FSDP2 over a
("data", "seq") mesh in `longstraw.distributed.fsdp`.
"""

from longstraw.distributed.gradient_slices import GradSlices, SliceLayout
from longstraw.distributed.launch import RankFailedError, run_on_ranks
from longstraw.distributed.sharded_group import (
    all_reduce_rank_gradients,
    sharded_group_gradient_slices,
    sharded_group_gradients,
)
from longstraw.distributed.sharded_prefill import sharded_prefill
from longstraw.distributed.sharded_replay import sharded_branch_logprobs, zeros_cotangent
from longstraw.distributed.sharded_rollout import (
    ReplicaDivergenceError,
    sharded_sample_responses,
)
from longstraw.distributed.sharded_state import gather_state, scatter_state
from longstraw.distributed.wavefront_prefill import wavefront_prefill

__all__ = [
    "GradSlices",
    "RankFailedError",
    "ReplicaDivergenceError",
    "SliceLayout",
    "all_reduce_rank_gradients",
    "gather_state",
    "run_on_ranks",
    "scatter_state",
    "sharded_branch_logprobs",
    "sharded_group_gradient_slices",
    "sharded_group_gradients",
    "sharded_prefill",
    "sharded_sample_responses",
    "wavefront_prefill",
    "zeros_cotangent",
]
