"""The configuration of a LongStraw training run, as loaded from `--config run.yaml`.

Every section is frozen and rejects unknown keys, so a typo in a YAML file is an error that names
the field rather than a silently ignored setting. GRPO knobs keep TRL's names (`GRPOConfig`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from longstraw.schemas.data import HaystackTaskConfig
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.merge import merge_fields, nested, tags_at
from longstraw.schemas.storage import StorageConfig
from longstraw.schemas.tracking import TrackingConfig

Family = Literal["llama", "qwen3", "qwen3_5", "qwen3_next", "glm_moe_dsa"]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class LoraConfig(_Section):
    """LoRA adapters trained on a frozen base (peft's `LoraConfig`, with its field names and
    meanings): the run trains only the adapters, keeps AdamW state for them alone, checkpoints
    them in peft's own format, and scores the KL reference on the base with the adapters
    disabled (no second copy of the weights)."""

    r: int = 8
    """Rank of every adapter (at least 1; 8–64 are usual)."""
    lora_alpha: float = 8.0
    """Scale numerator: the adapter's output is multiplied by lora_alpha / r (lora_alpha / √r
    with `use_rslora`)."""
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while the policy is trained. Only with
    `engine.prompt_grad: detached`: the exact sweep recomputes every prefill shard and must
    reproduce its first pass bit for bit, which a fresh dropout mask does not."""
    target_modules: list[str] | str = "all-linear"
    """Modules that get an adapter: names or name suffixes (`[q_proj, v_proj]`), a regex (a
    string), or `all-linear` (every linear layer but the output layer; on MoE models also the
    routed experts and routers, through peft's parameter wrappers)."""
    exclude_modules: list[str] | str | None = None
    """Modules left without an adapter, matched as `target_modules` is."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Which biases train too: none, every bias of the model, or those of adapted layers."""
    use_rslora: bool = False
    """Rank-stabilised scaling lora_alpha / √r instead of lora_alpha / r."""
    init_lora_weights: bool | Literal["gaussian"] = True
    """How the adapters start: True (peft's default: A Kaiming-uniform, B zero, so the policy
    starts as the base), "gaussian" (A normal), or False (random B too: the policy starts
    elsewhere than the base; for tests)."""
    layers_to_transform: list[int] | int | None = None
    """Decoder layer indices that get adapters (None: all)."""
    rank_pattern: dict[str, int] = Field(default_factory=dict)
    """Per-module ranks that differ from `r`, by name pattern (peft's `rank_pattern`)."""
    alpha_pattern: dict[str, float] = Field(default_factory=dict)
    """Per-module alphas that differ from `lora_alpha`, by name pattern."""

    @field_validator("r")
    @classmethod
    def _rank_at_least_one(cls, r: int) -> int:
        if r < 1:
            raise ValueError(
                f"model.lora.r is {r}: an adapter needs rank 1 or more — set model.lora.r to "
                "8, 16 or 64 (or remove model.lora to train every parameter)"
            )
        return r


class ModelConfig(_Section):
    """Which checkpoint to train, and in what precision."""

    checkpoint: str | None = None
    """A Hugging Face checkpoint directory (safetensors), or a Hugging Face model id
    (`Qwen/Qwen3-0.6B`) already in the local Hugging Face cache (`HF_HUB_CACHE`, else
    `$HF_HOME/hub`): looked up offline, never downloaded (`hf download <id>` fills the cache).
    A directory of that name wins. None: build a random-weight checkpoint of
    `init_family`/`init_size` under the storage root on first use (the embedded demo)."""
    init_family: Family = "qwen3_5"
    """Family of the checkpoint built when `checkpoint` is None."""
    init_size: Literal["tiny", "small"] = "tiny"
    """Size of the checkpoint built when `checkpoint` is None."""
    init_seed: int = Field(default=42, ge=0)
    """Seed of the random weights of a built checkpoint."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and activations dtype. Gradients and the prompt cotangent are fp32 either way."""
    reference_checkpoint: str | None = None
    """Reference model for the KL term (beta > 0): a directory or a cached model id, as
    `checkpoint`. None: the run's initial checkpoint."""
    device: Literal["auto", "cpu"] = "auto"
    """auto: each process computes on its local rank's GPU when CUDA is available, else the CPU;
    cpu: always the CPU."""
    lora: LoraConfig | None = None
    """Train LoRA adapters on the frozen `checkpoint` instead of every parameter (None: full
    training). A run's fresh adapters are drawn from `train.seed`. Checkpoints then hold the
    adapters (`adapter_config.json`, `adapter_model.safetensors`: `PeftModel.from_pretrained`
    loads them on the base); `longstraw merge` writes a merged Hugging Face checkpoint."""


class EngineConfig(_Section):
    """How the prompt is prefilled and how its gradient is taken."""

    shard_tokens: int = Field(default=23, ge=1)
    """Prompt tokens per prefill shard: activation memory is bounded by one shard, and the exact
    sweep recomputes one shard at a time. The default splits the demo's 64-token prompts into
    three shards (23/23/17); use 2048–8192 for real prompts."""
    prompt_grad: Literal["exact", "detached"] = "exact"
    """exact: the true gradient through the prompt state (reverse sweep, ~one extra prompt
    forward+backward); detached: treat the prompt state as a constant (the original system's
    capacity mode, biased). Measured on a long-context retrieval task at 2,048 tokens: exact
    reached 60.2 % held-out against detached's 54.2 % after 300 GRPO steps, at 2.6x the step's
    seconds (docs/benchmarks.md, "Learning at long context")."""
    branch_segment_tokens: int | None = Field(default=None, ge=1)
    """Responses longer than this are replayed in segments of this many tokens, one segment's
    autograd graph at a time, on top of the prompt state and the response's own earlier
    segments (gradients unchanged; about one extra forward of the response). None: every
    response is one graph. On several ranks every rank replays the segments together, each
    reading its part of the prompt."""
    share_response_prefixes: bool = False
    """Responses of a group that start with the same tokens (common first turns of agent
    trajectories) run that shared part once, as a prefix tree (gradients unchanged), on one
    process or on the ranks (as `branch_segment_tokens`)."""
    state_budget_bytes: int | None = Field(default=None, ge=0)
    """Bytes of prompt state (K/V or latents, and in exact mode their fp32 cotangent) kept on the
    compute device; whole layers are kept while they fit, the rest waits in `state_tier` and is
    streamed in chunks of the attention kernels' prefix grid (1024 positions), the next chunk
    prefetched while one computes. None keeps everything resident. Numbers are bitwise those of
    the resident run; peak is at most max(budget, one chunk unit) + one prefetched chunk unit,
    a chunk unit being 1024 positions of every streamed array of one layer (so 0 works). In
    `longstraw train` it applies to rollout, scoring and the backward stage; the step metrics
    report the peak and the bytes moved. On several ranks it is per rank: each streams its own
    slice of the state (and of its cotangent); the metrics report the busiest rank's figures."""
    state_tier: Literal["host", "disk"] = "host"
    """Where the state beyond the budget lives: host memory, or a scratch file in `state_dir`."""
    state_dir: str | None = None
    """Directory of the scratch files of `state_tier: disk` (None: the system temp directory)."""
    sweep_checkpoint_seconds: float | None = Field(default=600.0, gt=0)
    """Exact mode: the reverse sweep commits what the rest of it needs (the cotangent of the
    shards not yet swept, the gradient so far) after the first shard that ends this many
    seconds after its previous checkpoint (or its start), and at least 20 times as long after
    it as that checkpoint took to write, so that writing costs at most 5 % of the sweep; a
    backward stage run again (`--resume`, a task retry) continues after the latest. Written
    under `storage.root_uri` (not with `persist_mode: off`). None: not by time."""
    sweep_checkpoint_every: int | None = Field(default=None, ge=1)
    """Also commit a sweep checkpoint after every this many shards (None: by time only)."""


class HaystackDataConfig(_Section):
    """Synthetic long-context prompts generated locally, one task per prompt."""

    type: Literal["haystack"] = "haystack"
    """Discriminator of the `data` section."""
    task: HaystackTaskConfig = Field(
        default_factory=lambda: HaystackTaskConfig.tiny(
            num_prompt_tokens=64, value_alphabet="0123456789"
        )
    )
    """The task template; each prompt uses `task.seed + prompt index` as its seed."""
    num_prompts: int = Field(default=64, ge=1)
    """Distinct prompts the generator cycles through."""
    rewards: list[str] = Field(default_factory=lambda: ["haystack_shaped"])
    """Reward specs: registered names or `package.module:function`. The default gives half credit
    for answering in the value alphabet, so a model trained from random weights gets a signal."""


class JsonlDataConfig(_Section):
    """Users' prompts from a JSONL file (format: docs/data.md)."""

    type: Literal["jsonl"] = "jsonl"
    """Discriminator of the `data` section."""
    path: str
    """The JSONL prompt dataset."""
    rewards: list[str] = Field(min_length=1)
    """Reward specs used for records that do not name their own `reward`."""
    responses_path: str | None = None
    """Responses generated elsewhere (JSONL of `ResponseRecord`, docs/data.md), keyed by prompt
    id: train on them instead of sampling here. Each must name the current policy version."""


DataConfig = Annotated[HaystackDataConfig | JsonlDataConfig, Field(discriminator="type")]


class EvalConfig(_Section):
    """Held-out prompts the policy answers every `train.eval_steps` steps, without gradients:
    their rewards are logged beside the step's own (`eval/reward`, `eval/reward_std`, ...)."""

    data: DataConfig
    """The held-out prompts, a source like `data`: `type: jsonl` (every record of the file is
    evaluated) or `type: haystack` (its `num_prompts` prompts; give `task.seed` another value
    than the training task's so that they are not the training prompts)."""
    do_sample: bool = False
    """False: greedy decoding (the most likely token at each position, transformers'
    `do_sample=False`); True: sample at `temperature` with `grpo.top_p`/`top_k`/`min_p`."""
    num_generations: int = Field(default=1, ge=1)
    """Responses per held-out prompt (more than 1 only with `do_sample`: greedy gives one)."""
    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature when `do_sample`."""

    @model_validator(mode="after")
    def _greedy_is_one_response(self) -> EvalConfig:
        if not self.do_sample and self.num_generations > 1:
            raise ValueError(
                f"eval.num_generations is {self.num_generations} with greedy decoding, which "
                "gives the same response every time — set eval.num_generations: 1, or "
                "eval.do_sample: true to sample several"
            )
        if getattr(self.data, "responses_path", None) is not None:
            raise ValueError(
                "eval.data.responses_path is set: evaluation samples the policy's own "
                "responses — remove eval.data.responses_path"
            )
        return self


class AgentConfig(_Section):
    """Multi-turn rollout with an environment: assistant turns are sampled, the environment's
    answers are appended between them (not trained), until it says done."""

    environment: str
    """A registered environment (`key_lookup`, `calculator`) or `package.module:Class` with
    reset(metadata) and step(assistant_text) -> (observation, done, reward)."""
    environment_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    max_turns: int = Field(default=4, ge=1)
    """Assistant turns per trajectory."""
    max_turn_tokens: int = Field(default=64, ge=1)
    """Tokens one assistant turn may sample (it ends earlier at the template's end-of-turn
    token). The whole trajectory's budget, observations included, is
    `grpo.max_completion_length`."""
    step_timeout_s: float = Field(default=30.0, gt=0)
    """Longest wait for one environment call; a slower or failing environment ends that
    trajectory with the error recorded (reward `error_reward`), never the step."""
    error_reward: float = Field(default=0.0, allow_inf_nan=False)
    """Reward of a trajectory the environment ended with an error or a time-out. A trajectory
    the environment gave no reward is scored by `data.rewards` on its last assistant turn."""
    system_prompt: bool = True
    """Start each prompt with the environment's `system_prompt` (if it has one)."""


class TrainConfig(_Section):
    """The training loop."""

    num_steps: int = Field(default=8, ge=1)
    """Optimizer steps (policy versions) to run."""
    groups_per_step: int = Field(default=2, ge=1)
    """Prompts (GRPO groups) whose gradients are summed into one optimizer step."""
    checkpoint_every: int = Field(default=1, ge=1)
    """Write a Hugging Face checkpoint every this many steps (and always after the last)."""
    save_total_limit: int | None = Field(default=None, ge=1)
    """Keep only the latest this many checkpoints of the run (transformers' name), and the
    optimizer state only in the latest one (what a resume starts from). None: keep every
    checkpoint with its optimizer state."""
    keep_best_checkpoint: bool = False
    """With `save_total_limit`: also keep the checkpoint whose policy had the highest mean
    reward over the recorded steps (its weights only)."""
    seed: int = Field(default=42, ge=0)
    """Seed of sampling and data order: each group samples from a generator seeded by (seed,
    step, prompt), so a resumed run or another process draws the same responses."""
    eval_steps: int | None = Field(default=None, ge=1)
    """Evaluate the policy on the `eval` prompts after every this many steps (transformers'
    name: after steps N, 2N, ..., counting from 1). None: no evaluation."""


class ParallelConfig(_Section):
    """Processes that share one step (torch.distributed)."""

    world_size: int = Field(default=1, ge=1)
    """Ranks of the run: `data_parallel` replicas × the sequence ranks that shard each prompt's
    state (1: a single process). Prefill, rollout, scoring and backward of a group run on the
    sequence ranks of one replica. Without torchrun, `longstraw train` starts the other ranks
    itself on this machine; under torchrun (several nodes) it must equal WORLD_SIZE."""
    data_parallel: int = Field(default=1, ge=1)
    """R: replicas of the sequence-sharded engine; a step's groups are spread over them (group i
    of the step on replica i mod R; a prompt the step holds twice stays on one replica) and run
    at once, and their gradients are summed across the replicas once per update. Replica d is
    ranks d·S … d·S + S − 1 (S = world_size / R): under torchrun, one replica per node keeps a
    prompt's traffic on the node. `world_size` must be a multiple of it."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """torch.distributed backend of the tensors' traffic: gloo on CPU, nccl on GPUs (control
    messages between the ranks always go over gloo)."""
    schedule: Literal["sequential", "wavefront"] = "sequential"
    """Prefill schedule over the ranks: sequential (shard by shard, each recorded as it is
    computed) or wavefront (every rank computing at once; bitwise the same state, recorded when
    the wavefront ends)."""
    timeout_s: float = Field(default=1800.0, gt=0)
    """Longest wait for another rank inside one collective before the step fails (a rank that
    died is usually noticed at once, by its closed connection)."""

    @model_validator(mode="after")
    def _replicas_divide_ranks(self) -> ParallelConfig:
        if self.world_size % self.data_parallel:
            raise ValueError(
                f"world_size {self.world_size} is not a multiple of data_parallel "
                f"{self.data_parallel}: set world_size to data_parallel × the sequence ranks of "
                f"one replica (e.g. {self.data_parallel * max(1, self.world_size // self.data_parallel)})"
            )
        return self

    @property
    def sequence_ranks(self) -> int:
        """S: the ranks that share one prompt's state (world_size / data_parallel)."""
        return self.world_size // self.data_parallel


class RunConfig(_Section):
    """A whole training run."""

    run_id: str = Field(default="demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Name of the run: the storage key space and checkpoint folder (letters, digits, . _ -)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The checkpoint to train and its dtype."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """Prefill sharding and the prompt-gradient mode."""
    grpo: GRPOConfig = Field(
        # The demo's settings: a tiny random model learns to answer in the value alphabet within
        # a few steps at this learning rate (TRL's default 1e-6 suits pretrained models).
        default_factory=lambda: GRPOConfig(
            num_generations=8, max_completion_length=2, learning_rate=5e-2, loss_type="grpo"
        )
    )
    """GRPO algorithm and optimizer knobs, with TRL's `GRPOConfig` names."""
    data: DataConfig = Field(default_factory=HaystackDataConfig)
    """Where prompts come from: `type: haystack` (synthetic) or `type: jsonl` (a user dataset)."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Steps, groups per step, checkpoint cadence and seed."""
    storage: StorageConfig = Field(default_factory=StorageConfig)
    """Where prompt states and checkpoints live, and how prompt states are persisted."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """torch.distributed processes sharing one step."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Experiment trackers (TensorBoard, MLflow, W&B, Trackio) that receive every step's metrics
    (none by default)."""
    eval: EvalConfig | None = None
    """Held-out prompts evaluated every `train.eval_steps` steps (None: no evaluation)."""
    agent: AgentConfig | None = None
    """Multi-turn rollout with an environment (None: one sampled response per branch, scored by
    `data.rewards`). Prompts are then framed by the tokenizer's chat template, and the
    environment's reward is the trajectory's."""

    @model_validator(mode="after")
    def _agent_fits(self) -> RunConfig:
        if self.agent is None:
            return self
        if getattr(self.data, "responses_path", None) is not None:
            raise ValueError(
                "agent and data.responses_path are both set: either sample trajectories with "
                "the environment or train on imported responses, not both"
            )
        return self

    @model_validator(mode="after")
    def _eval_has_steps_and_prompts(self) -> RunConfig:
        if self.train.eval_steps is not None and self.eval is None:
            raise ValueError(
                "train.eval_steps is set but there is no eval section — add eval: {data: ...} "
                "with the held-out prompts, or remove train.eval_steps"
            )
        if self.eval is not None and self.train.eval_steps is None:
            raise ValueError(
                "the eval section is set but train.eval_steps is not — set train.eval_steps "
                "(evaluate every that many steps), or remove the eval section"
            )
        if self.eval is not None and self.agent is not None:
            raise ValueError(
                "eval is not supported in agent runs yet (held-out prompts are answered in one "
                "turn, without the environment) — remove the eval section or the agent section"
            )
        return self

    @model_validator(mode="after")
    def _lora_dropout_is_replayed_once(self) -> RunConfig:
        lora, engine = self.model.lora, self.engine
        if lora is None or lora.lora_dropout == 0:
            return self
        recomputed = [
            (engine.prompt_grad == "exact", "engine.prompt_grad is exact", "detached"),
            (
                engine.branch_segment_tokens is not None,
                "engine.branch_segment_tokens is set",
                "null",
            ),
            (engine.share_response_prefixes, "engine.share_response_prefixes is on", "false"),
        ]
        for found, what, fix in recomputed:
            if found:
                field = what.split(" is ")[0]
                raise ValueError(
                    f"model.lora.lora_dropout is {lora.lora_dropout} and {what}: that path "
                    "recomputes forwards and checks them bit for bit against the first pass, "
                    f"which a new dropout mask breaks — set model.lora.lora_dropout: 0, or "
                    f"{field}: {fix}"
                )
        return self

    @model_validator(mode="after")
    def _lora_reference_is_the_base(self) -> RunConfig:
        lora = self.model.lora
        if (
            lora is not None
            and lora.bias != "none"
            and self.grpo.beta > 0
            and self.model.reference_checkpoint is None
        ):
            raise ValueError(
                f"model.lora.bias is {lora.bias} with grpo.beta > 0: the KL reference is the base "
                "with the adapters disabled, and disabling them does not undo trained biases — "
                "set model.lora.bias: none, or name the base as model.reference_checkpoint"
            )
        return self

    @model_validator(mode="after")
    def _reference_needs_beta(self) -> RunConfig:
        if self.model.reference_checkpoint is not None and self.grpo.beta == 0.0:
            raise ValueError(
                "model.reference_checkpoint is set but grpo.beta is 0: set grpo.beta > 0 to use the "
                "reference model, or remove model.reference_checkpoint"
            )
        return self


class ConfigError(ValueError):
    """A run configuration file that cannot be used, with every offending field named."""


def merged(base: dict, *layers: dict) -> dict:
    """`base` (a run config mapping, whole or partial) with each of `layers` merged onto it in
    order, field by field onto the effective values (`longstraw.schemas.merge`): a layer changes
    only the fields it names."""
    return merge_fields(RunConfig, base, *layers)


def parse_run_config(text: str, source: str, *layers: dict) -> RunConfig:
    """A RunConfig from YAML `text` (named `source` in errors) with each of `layers` (overrides)
    merged onto it in order."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{source} is not valid YAML: {error}") from error
    if raw is None:
        # An empty file is a mistake (a truncated copy, the wrong path), not a request for the demo.
        raise ConfigError(
            f"{source} is empty — write the run's settings in it (docs/config.md), or leave out "
            "--config to run the embedded demo"
        )
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source} must hold a mapping of sections (model:, grpo:, ...), got {type(raw).__name__}"
        )
    return validated_run_config(merged(raw, *layers), source)


def validated_run_config(raw: dict, source: str) -> RunConfig:
    """Validate a config mapping; errors name `source` and each bad field by its dotted path."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as error:
        lines = [f"{source}: {error.error_count()} invalid setting(s):"]
        for item in error.errors():
            where = ".".join(str(part) for part in item["loc"]) or "(top level)"
            lines.append(f"  {where}: {_error_message(item)}")
        raise ConfigError("\n".join(lines)) from error


def _error_message(item: dict) -> str:
    """pydantic's message, or where it does not say what to change, one that does."""
    if item["type"] == "union_tag_not_found":
        # pydantic: "Unable to extract tag using discriminator 'type'".
        key = item["ctx"]["discriminator"].strip("'")
        tags = " or ".join(repr(tag) for tag in tags_at(RunConfig, tuple(item["loc"])))
        return f"no '{key}' given — add {key}: {tags} (which kind of section this is)"
    return item["msg"]


def load_run_config(path: str | Path, **overrides) -> RunConfig:
    """Read a YAML run config; `overrides` (sections or values) are merged onto it."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError as error:
        raise ConfigError(f"config file {path} does not exist") from error
    config = parse_run_config(text, str(path), overrides)
    import_beside(path)
    return config


def command_line_config(config_path: Path | None, flags: Mapping[str, Any]) -> RunConfig:
    """`longstraw train`'s config: the YAML file at `config_path` (the defaults without one), then
    the flags (dotted field → value: {"parallel.world_size": 2}) merged onto it field by field, so
    that any flags of one section combine. The file's errors name the file, the flags' errors
    "command-line options". Schemas only: the CLI calls this before it imports torch."""
    config = load_run_config(config_path) if config_path is not None else RunConfig()
    if not flags:
        return config
    raw = merged(config.model_dump(mode="json"), nested(flags))
    return validated_run_config(raw, "command-line options")


def import_beside(config_file: Path) -> None:
    """Put the config file's directory first on sys.path, as `PYTHONPATH=<that directory>`
    would: a `module:function` reference (`data.rewards`, a record's `reward`,
    `agent.environment`) to `module.py` beside the file imports from any working directory.

    For the rest of the process, not only while a reference is imported: a reward module that
    imports a sibling later (inside its function) finds it too, and the ranks a run spawns get
    the driver's sys.path. A directory already on sys.path is left where it is."""
    directory = str(config_file.expanduser().resolve().parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
