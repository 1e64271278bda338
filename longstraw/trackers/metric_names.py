"""A step's record under the names trackers show: TRL's GRPOTrainer names where LongStraw
computes the same quantity, `longstraw/...` for the rest. docs/operations.md has the table."""

from __future__ import annotations

from longstraw.schemas.results import StepMetrics

TRL_NAMES: dict[str, str] = {
    "reward": "reward_mean",
    "reward_std": "reward_std",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "kl": "kl",
    "clip_ratio/low_mean": "clip_ratio_low",
    "clip_ratio/high_mean": "clip_ratio_high",
    "clip_ratio/region_mean": "clip_ratio_region",
    "completions/mean_length": "completion_length_mean",
    "completions/min_length": "completion_length_min",
    "completions/max_length": "completion_length_max",
    "completions/clipped_ratio": "truncated_fraction",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "learning_rate": "learning_rate",
}
"""TRL's name -> the StepMetrics field holding that quantity."""

LONGSTRAW_NAMES: dict[str, str] = {
    "longstraw/policy_version": "policy_version",
    "longstraw/num_groups": "num_groups",
    "longstraw/prompt_tokens": "prompt_tokens",
    "longstraw/completion_tokens": "completion_tokens",
    "longstraw/advantage_mean": "advantage_mean",
    "longstraw/advantage_std": "advantage_std",
    "longstraw/advantage_min": "advantage_min",
    "longstraw/advantage_max": "advantage_max",
    "longstraw/shards_computed": "shards_computed",
    "longstraw/shards_reused": "shards_reused",
    "longstraw/sweep_shards_computed": "sweep_shards_computed",
    "longstraw/sweep_shards_resumed": "sweep_shards_resumed",
    "longstraw/state_bytes": "state_bytes",
    "longstraw/state_peak_resident_bytes": "state_peak_resident_bytes",
    "longstraw/state_bytes_read": "state_bytes_read",
    "longstraw/state_bytes_written": "state_bytes_written",
    "longstraw/peak_rss_bytes": "peak_rss_bytes",
    "longstraw/trainable_parameters": "trainable_parameters",
    "longstraw/turns_mean": "turns_mean",
    "longstraw/environment_errors": "environment_errors",
}
"""LongStraw's own numbers -> their StepMetrics fields."""

EVAL_NAMES: dict[str, str] = {
    "eval/reward": "reward_mean",
    "eval/reward_std": "reward_std",
    "eval/reward_min": "reward_min",
    "eval/reward_max": "reward_max",
    "eval/completions/mean_length": "completion_length_mean",
    "eval/completions/clipped_ratio": "truncated_fraction",
    "eval/num_prompts": "num_prompts",
    "eval/policy_version": "policy_version",
}
"""The evaluation of a step (`StepMetrics.eval`, every `train.eval_steps`) -> its EvalMetrics
fields; logged at the step whose update made the weights evaluated."""

SECONDS_PREFIX = "longstraw/seconds/"
"""`longstraw/seconds/<stage>`: wall-clock seconds of each stage the step ran (prefill, rollout,
reward, reference, score_old, replay, sweep, update, eval, checkpoint), and `total`."""

AGENT_ONLY = frozenset({"longstraw/turns_mean", "longstraw/environment_errors"})


def tracker_metrics(metrics: StepMetrics, agent: bool) -> dict[str, float]:
    """The numbers a tracker logs for one step. A quantity the step did not measure (`kl` with
    beta = 0, the tiered-state peak without a budget, the agent numbers outside agent runs) is
    left out rather than logged as 0."""
    out: dict[str, float] = {}
    for name, field in (TRL_NAMES | LONGSTRAW_NAMES).items():
        if name in AGENT_ONLY and not agent:
            continue
        value = getattr(metrics, field)
        if value is not None:
            out[name] = float(value)
    if metrics.eval is not None:
        for name, field in EVAL_NAMES.items():
            out[name] = float(getattr(metrics.eval, field))
    for stage, seconds in metrics.seconds.items():
        out[SECONDS_PREFIX + stage] = float(seconds)
    out[SECONDS_PREFIX + "total"] = float(sum(metrics.seconds.values()))
    return out
