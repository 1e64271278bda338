"""What engine calls and tasks report back: plain numbers, no tensors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class StageSeconds(BaseModel):
    """Wall-clock seconds per stage of one group's gradient."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill: float = 0.0
    """Prefill of prompt[:-1] (0 when an existing state was passed in)."""
    replay: float = 0.0
    """All branch forwards + backwards."""
    sweep: float = 0.0
    """Exact mode's reverse sweep over the prefill shards."""


class StateTraffic(BaseModel):
    """What a tiered prompt state (`engine.state_budget_bytes`) held and moved during one stage."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    peak_resident_bytes: int = Field(ge=0)
    """Peak bytes of state (and, in exact mode, its fp32 cotangent) on the compute device, as
    counted by the store: layers kept for good plus the streamed chunks."""
    bytes_read: int = Field(ge=0)
    """Read from the lower tier (host memory, scratch file or committed Zarr state)."""
    bytes_written: int = Field(ge=0)
    """Written back to the lower tier (the cotangent's read-modify-write; 0 without one)."""


class GroupStats(BaseModel):
    """Result of `accumulate_group_gradients` for one GRPO group."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_grad: str
    """"exact" or "detached"."""
    loss: float
    """Sum of the branches' shares of the loss (the group's contribution to the step loss)."""
    branch_losses: list[float]
    """[G] each branch's share."""
    branch_logprobs: list[list[float]]
    """[G][R_i] per-token log-probs of each response under the current policy."""
    num_tokens: list[int]
    """[G] completion tokens counted by the loss (after loss masks)."""
    prompt_tokens: int
    num_shards: int
    kl: float | None = None
    """Mean k3 KL to the reference over counted tokens (None when beta = 0)."""
    clip_ratio_low: float = 0.0
    clip_ratio_high: float = 0.0
    clip_ratio_region: float = 0.0
    seconds: StageSeconds = Field(default_factory=StageSeconds)
    peak_rss_bytes: int = 0
    """Peak resident set of this process so far (ru_maxrss): meaningful in a fresh process."""
    peak_device_bytes: int | None = None
    """torch.cuda.max_memory_allocated when the model is on CUDA."""
    state_bytes: int = 0
    """Per-token prompt state (K/V) held during the step."""
    checkpoint_bytes: int = 0
    """Per-shard linear-attention checkpoints (host memory)."""
    cotangent_bytes: int = 0
    """fp32 prompt-state cotangent dS (exact mode; 0 in detached mode)."""
    state_traffic: StateTraffic | None = None
    """The tiered state's peak and bytes moved over replay and sweep (None: no budget, the
    state resident)."""
    sweep_shards_computed: int = 0
    """Prefill shards the exact sweep recomputed and backpropagated in this stage."""
    sweep_shards_resumed: int = 0
    """Shards it took from a sweep checkpoint instead (swept before a kill or a failure)."""


class EvalMetrics(BaseModel):
    """The held-out prompts answered by the policy a step made (`eval`, `train.eval_steps`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy_version: int = Field(ge=0)
    """Version of the weights evaluated (the step's update made it)."""
    num_prompts: int = Field(ge=1)
    num_completions: int = Field(ge=1)
    reward_mean: float
    reward_std: float
    """Standard deviation of all the completions' rewards (Bessel-corrected; 0 for one)."""
    reward_min: float
    reward_max: float
    completion_length_mean: float
    """Tokens per completion."""
    truncated_fraction: float
    """Completions that hit `grpo.max_completion_length`."""
    rewards: list[list[float]]
    """[prompts][num_generations] every completion's reward, in prompt order."""


class StepMetrics(BaseModel):
    """One optimizer step of a training run: what the audit table, JSONL and plots show."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int
    """0-based optimizer step."""
    policy_version: int
    """Version of the weights that produced this step's rollouts (the update makes version + 1)."""
    reward_mean: float
    reward_std: float
    """Standard deviation of all the step's rewards (Bessel-corrected, TRL's `reward_std`)."""
    frac_reward_zero_std: float | None = None
    """Fraction of the step's groups whose rewards are all equal: zero advantage, no signal
    (None in rows recorded before it was: trackers leave it out)."""
    advantage_mean: float
    advantage_std: float
    advantage_min: float
    advantage_max: float
    loss: float
    kl: float | None = None
    clip_ratio_low: float = 0.0
    clip_ratio_high: float = 0.0
    clip_ratio_region: float = 0.0
    grad_norm: float = 0.0
    learning_rate: float = 0.0
    prompt_tokens: int = 0
    """Prompt tokens of the step's groups (summed)."""
    completion_tokens: int = 0
    """Completion tokens counted by the loss."""
    completion_length_mean: float | None = None
    """Tokens per completion the policy sampled (an agent trajectory's observations and chat
    framing not counted), over the step's completions (None in rows recorded before it was,
    as the two below)."""
    completion_length_min: int | None = None
    completion_length_max: int | None = None
    num_groups: int = 1
    truncated_fraction: float = 0.0
    """Responses that hit max_completion_length."""
    turns_mean: float | None = None
    """Assistant turns per agent trajectory (None: not an agent run)."""
    environment_errors: int = 0
    """Agent trajectories the environment ended with an error or a time-out."""
    seconds: dict[str, float] = Field(default_factory=dict)
    """Wall-clock seconds per stage: prefill, rollout, reward, reference, replay, sweep, update, checkpoint."""
    replica_sum_bytes: int = 0
    """Bytes a rank handed to the data-parallel replicas' gradient sum in this step (its slice
    of the gradient, once per update; 0 with one replica)."""
    step_seconds: float | None = None
    """Wall-clock seconds of the whole step, from planning to its record. With data-parallel
    replicas the groups' stages overlap, so this is less than the sum of `seconds`."""
    peak_rss_bytes: int = 0
    trainable_parameters: int | None = None
    """Parameters the optimizer updates: every parameter, or a LoRA run's adapters (None in rows
    recorded before it was)."""
    shards_computed: int = 0
    """Prefill shards computed this step (the rest were reused from storage)."""
    shards_reused: int = 0
    sweep_shards_computed: int = 0
    """Shards the exact reverse sweeps of the step recomputed (all groups and iterations)."""
    sweep_shards_resumed: int = 0
    """Shards they took from sweep checkpoints instead (a sweep resumed after a kill)."""
    state_bytes: int | None = None
    """The largest prompt state (K/V or latents) of the step's groups, in bytes (on several
    ranks, the part rank 0 holds; None in rows recorded before it was)."""
    state_peak_resident_bytes: int | None = None
    """Under `engine.state_budget_bytes`: the largest peak of device-resident prompt state over
    the step's rollout, scoring and backward stages (None: no budget)."""
    state_bytes_read: int = 0
    """Prompt-state bytes read from the lower tier over those stages (all groups)."""
    state_bytes_written: int = 0
    """Cotangent bytes written back to the lower tier (all groups)."""
    eval: EvalMetrics | None = None
    """The evaluation after this step's update (`train.eval_steps`); None on other steps."""


class AdvantagePlan(BaseModel):
    """Advantages, loss masks and the step's normalisers, fixed before any replay."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    advantages: list[list[float]]
    """[groups][G]"""
    loss_masks: list[list[list[float]]]
    """[groups][G][R_i]"""
    num_items_in_batch: float
    num_sequences_in_batch: int
