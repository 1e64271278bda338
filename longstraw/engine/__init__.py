"""The algorithm at any placement: prefill, replay, rollout, reverse sweep, group gradient.

One process is the placement with one rank; on a sequence group of ranks the same functions
run with the ranks' `PrefixExchange` (`longstraw.distributed.exchange.CrossRankExchange`).
"""

from longstraw.engine.group import GradBuffer, accumulate_group_gradients
from longstraw.engine.prefill import prefill
from longstraw.engine.recomputed_span import RecomputedStateMismatchError
from longstraw.engine.replay import PromptCotangent, branch_logprobs
from longstraw.engine.rollout import Response, SamplingParams, sample_responses, score_responses
from longstraw.engine.state import PrefixState, shard_bounds
from longstraw.engine.sweep import sweep_prompt_shards

__all__ = [
    "GradBuffer",
    "PrefixState",
    "PromptCotangent",
    "RecomputedStateMismatchError",
    "Response",
    "SamplingParams",
    "accumulate_group_gradients",
    "branch_logprobs",
    "prefill",
    "sample_responses",
    "score_responses",
    "shard_bounds",
    "sweep_prompt_shards",
]
