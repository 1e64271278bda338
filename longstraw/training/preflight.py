"""Checks that fail a run in one line before anything expensive starts (Prefect, a prefill).

`preflight(config, resume)` raises `UserError` ("<what> — <fix>") for the first problem found:
the model checkpoint (a directory, or a Hugging Face model id in the local cache) and the
reference one, `--resume` without a committed checkpoint, a storage root that cannot be written,
a missing JSONL dataset, reward specs that do not import or do not take
`(prompt, response, metadata)`, `grpo.reward_weights` of another length than the rewards, an
agent environment that does not load, a tracker of `tracking.report_to` whose package is
missing, more ranks than prefill shards, `parallel.backend: nccl` without a GPU per rank, every
prompt of a JSONL dataset, the held-out ones of `eval.data` too (each line parses, token ids
inside the model's vocabulary, prompt + response within its positions), and the free space of a local root against what one step
writes. No weights are loaded; a JSONL dataset is read (and its text prompts tokenized) once
per process.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

from longstraw.errors import UserError
from longstraw.schemas.run import RunConfig
from longstraw.trackers.run_trackers import check_trackers

S3_CREDENTIALS = "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL_S3"


def preflight(config: RunConfig, resume: bool) -> None:
    """Raise UserError naming the first thing that would make this run fail, and its fix."""
    check_model(config)
    check_lora(config)
    check_resume(config, resume)
    check_trackers(config)
    check_data(config)
    check_rewards(config)
    check_reward_weights(config)
    check_environment(config)
    check_world_size(config)
    check_backend(config)
    check_storage_writable(config)
    lengths = check_prompts(config)
    check_free_space(config, lengths)


def eval_preflight(config: RunConfig) -> None:
    """`preflight` of a checkpoint's evaluation (`longstraw eval`): the model, and the held-out
    prompts and their rewards; nothing of training (its data, storage, free space)."""
    check_model(config)
    check_data(config)
    check_rewards(config)
    _checked_prompts(config, "eval.data")


def check_model(config: RunConfig) -> None:
    from longstraw.models.adapters import SUPPORTED_MODEL_TYPES
    from longstraw.models.hub import resolve_checkpoint
    from longstraw.models.lora import adapter_base_path, is_lora_checkpoint

    if config.model.reference_checkpoint is not None:
        # A reference model id that is not in the cache is named before any work.
        resolve_checkpoint(config.model.reference_checkpoint, field="model.reference_checkpoint")
    if config.model.checkpoint is None:
        return  # built on first use (the demo)
    spec = config.model.checkpoint
    path = checkpoint_dir(config)  # a model id that is not in the cache is refused here
    # A model id is named with its snapshot, so that a broken download is found in the cache.
    what = (
        f"model.checkpoint {path}"
        if path == Path(spec).expanduser()
        else f"model.checkpoint {spec} (snapshot {path})"
    )
    fix = (
        "point model.checkpoint at a Hugging Face checkpoint directory (config.json + safetensors)"
    )
    if not path.exists():
        raise UserError(f"{what} does not exist — {fix}")
    if is_lora_checkpoint(path) and not (path / "config.json").is_file():
        raise UserError(
            f"{what} is a LoRA adapter (adapter_config.json), not a model — point "
            f"model.checkpoint at its base ({adapter_base_path(path)}), or merge the adapter "
            f"into it first (longstraw merge {path} --out DIR) and train on DIR"
        )
    if not path.is_dir() or not (path / "config.json").is_file():
        raise UserError(f"{what} is not a directory with a config.json — {fix}")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{what}: config.json is unreadable ({err}) — {fix}") from err
    types = {raw.get("model_type"), (raw.get("text_config") or {}).get("model_type")}
    if not types & set(SUPPORTED_MODEL_TYPES):
        raise UserError(
            f"{what} is a {raw.get('model_type')!r} model, which LongStraw does not "
            f"support — use one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not any(path.glob("*.safetensors")):
        raise UserError(f"{what} has no *.safetensors weights — {fix}")


def check_lora(config: RunConfig) -> None:
    """`model.lora` applies to the model: its targets exist, every adapter sits where LongStraw
    trains one, and a hand-written path that reads an adapted layer's weight can take it
    (`lora_meta_model`)."""
    if config.model.lora is not None:
        lora_meta_model(config)


_LORA_META: dict[str, object] = {}


def lora_meta_model(config: RunConfig):
    """The run's model with `model.lora` injected, on the meta device (no weights are read or
    allocated): UserError naming the field and its fix when peft cannot apply it or LongStraw
    cannot train what it makes. Once per model settings and process."""
    import torch
    from transformers import AutoModelForCausalLM

    from longstraw.models.lora import adapter_layers, with_lora

    key = config.model.model_dump_json()
    if key in _LORA_META:
        return _LORA_META[key]
    facts = _model_facts(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(facts.config)
        peft_model = with_lora(model, config.model.lora, seed=0)
    if config.model.lora.lora_dropout > 0:
        for name, _layer in adapter_layers(peft_model):
            if name.endswith("kv_b_proj"):
                module = name.removeprefix("base_model.model.")
                raise UserError(
                    f"model.lora.lora_dropout is {config.model.lora.lora_dropout} and "
                    f"model.lora.target_modules reaches {module}: GLM-5's absorbed attention "
                    "never forms kv_b_proj's input, so dropout there cannot be applied — set "
                    "model.lora.lora_dropout: 0, or add kv_b_proj to model.lora.exclude_modules"
                )
    _LORA_META[key] = peft_model
    return peft_model


def checkpoint_dir(config: RunConfig) -> Path:
    """The directory `model.checkpoint` names (set): itself, or a model id's cached snapshot."""
    from longstraw.models.hub import resolve_checkpoint

    assert config.model.checkpoint is not None
    return resolve_checkpoint(config.model.checkpoint)


def check_resume(config: RunConfig, resume: bool) -> None:
    """`--resume` of a run that started: its newest checkpoint that verifies (damaged ones are
    set aside with a warning), or none yet (it restarts from the initial weights)."""
    from longstraw.storage.checkpoints import latest_valid_checkpoint, run_dir, run_started

    if not resume:
        return
    if not run_started(config.storage, config.run_id):
        raise UserError(
            f"--resume: run {config.run_id!r} has never started under "
            f"{run_dir(config.storage, config.run_id)} — check --run-id and the storage root, or "
            "start it without --resume"
        )
    latest_valid_checkpoint(config.storage, config.run_id)


def data_sections(config: RunConfig) -> list[tuple[str, object]]:
    """(where in the config, the prompt source) of the training prompts and the held-out ones."""
    sections = [("data", config.data)]
    if config.eval is not None:
        sections.append(("eval.data", config.eval.data))
    return sections


def check_data(config: RunConfig) -> None:
    for section, data in data_sections(config):
        if data.type != "jsonl":
            continue
        for field in ("path", "responses_path"):
            value = getattr(data, field)
            if value is not None and "://" not in value and not Path(value).expanduser().is_file():
                raise UserError(
                    f"{section}.{field} {value} does not exist — give the path of the JSONL "
                    "file (relative paths are taken from the current directory)"
                )


def check_rewards(config: RunConfig) -> None:
    from longstraw.data.rewards import register_haystack_rewards
    from longstraw.grpo.rewards import get_reward

    register_haystack_rewards()

    specs = [
        (f"{section}.rewards", spec) for section, d in data_sections(config) for spec in d.rewards
    ]
    for field, spec in specs:
        try:
            fn = get_reward(spec)
        except ValueError as err:
            what, _, fix = str(err).rpartition("; ")  # get_reward's messages end in "; <fix>"
            raise UserError(f"{field}: {what} — {fix}" if what else f"{err}") from err
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            continue  # a builtin or C callable: nothing to inspect
        try:
            signature.bind("prompt", "response", {})
        except TypeError as err:
            raise UserError(
                f"{field}: reward {spec!r} has the signature {signature}, which cannot be "
                f"called as (prompt, response, metadata) ({err}) — define it as "
                "def reward(prompt: str, response: str, metadata: dict) -> float"
            ) from err


def check_environment(config: RunConfig) -> None:
    """An agent run's environment imports, has reset/step and takes its environment_args."""
    if config.agent is None:
        return
    from longstraw.data.environments import environment_factory

    try:
        environment_factory(config.agent.environment, config.agent.environment_args)
    except UserError as exc:
        raise UserError(f"agent.environment: {exc} — fix agent.environment or its args") from None


def check_world_size(config: RunConfig) -> None:
    from longstraw.engine.state import shard_bounds

    parallel = config.parallel
    if parallel.sequence_ranks == 1:
        return
    for section, data in data_sections(config):
        if data.type != "haystack":
            continue  # a JSONL prompt's length is known only once it is tokenized
        tokens = data.task.num_prompt_tokens
        shards = len(shard_bounds(tokens - 1, config.engine.shard_tokens))
        if parallel.sequence_ranks > shards:
            ranks, fixes = f"parallel.world_size {parallel.world_size}", "parallel.world_size"
            if parallel.data_parallel > 1:
                ranks = (
                    f"{ranks} / parallel.data_parallel {parallel.data_parallel} = "
                    f"{parallel.sequence_ranks} sequence ranks"
                )
                fixes = "parallel.world_size (or raise parallel.data_parallel)"
            raise UserError(
                f"{ranks} is more than the {shards} prefill shards of a {tokens}-token prompt "
                f"of {section} (engine.shard_tokens {config.engine.shard_tokens}) — lower "
                f"{fixes} or engine.shard_tokens"
            )


def _probe_local(directory: Path, what: str) -> None:
    probe = directory / f".longstraw-probe-{uuid.uuid4().hex}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as err:
        raise UserError(
            f"{what} {directory} is not writable ({err.strerror or err}) — fix its permissions or "
            "free space, or point it at another directory"
        ) from err


def check_storage_writable(config: RunConfig) -> None:
    from longstraw.storage.checkpoints import local_root
    from longstraw.storage.paths import filesystem, join

    storage = config.storage
    if storage.root_uri.startswith("file://"):
        _probe_local(local_root(storage), "storage.root_uri")
        return
    _probe_local(local_root(storage), "storage.local_dir (checkpoints and metrics)")
    probe = join(storage.root_uri, f".longstraw-probe-{uuid.uuid4().hex}")
    try:
        fs, _ = filesystem(storage.root_uri, storage)
        _, path = filesystem(probe, storage)
        fs.pipe_file(path, b"probe")
        fs.rm_file(path)
    except Exception as err:  # any client error: credentials, endpoint, bucket
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise UserError(
            f"storage.root_uri {storage.root_uri} is not writable ({type(err).__name__}: {first}) "
            f"— check the bucket and the credentials in {S3_CREDENTIALS} (or storage.s3_endpoint_url)"
        ) from err


def check_reward_weights(config: RunConfig) -> None:
    """One weight per reward of `data.rewards` (a JSONL record's own `reward` is checked with
    the records)."""
    weights = config.grpo.reward_weights
    if weights is not None and len(weights) != len(config.data.rewards):
        raise UserError(
            f"grpo.reward_weights has {len(weights)} weight(s) for the {len(config.data.rewards)} "
            f"reward(s) of data.rewards ({', '.join(config.data.rewards)}) — give one weight per "
            "reward, in the same order, or remove grpo.reward_weights"
        )


def check_backend(config: RunConfig) -> None:
    """NCCL moves tensors between GPUs only: every rank needs its own CUDA device."""
    parallel = config.parallel
    if parallel.backend != "nccl" or parallel.world_size == 1:
        return  # one process opens no process group
    import torch

    fix = "set parallel.backend: gloo to run the ranks on CPUs"
    if config.model.device == "cpu":
        raise UserError(f"parallel.backend nccl needs GPUs, but model.device is cpu — {fix}")
    if not torch.cuda.is_available():
        raise UserError(
            f"parallel.backend nccl needs GPUs, but CUDA is not available on this machine "
            f"(torch {torch.__version__}) — {fix}, or run on a machine with CUDA GPUs"
        )
    # Ranks on this machine: what torchrun started here, or all of them when train spawns them.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", parallel.world_size))
    count = torch.cuda.device_count()
    if local > count:
        raise UserError(
            f"parallel.backend nccl runs {local} ranks on this machine but it has {count} GPU(s) "
            f"— lower parallel.world_size to {count}, or spread the ranks over machines with "
            "torchrun"
        )


@dataclass(frozen=True)
class _ModelFacts:
    vocab_size: int
    max_positions: int | None
    """None: RoPE scaling, no fixed limit."""
    config: object
    """The transformers config (text part)."""


def _model_facts(config: RunConfig) -> _ModelFacts:
    from transformers import AutoConfig

    from longstraw.models.adapters import _text_config, state_spec
    from longstraw.models.factory import build_config

    m = config.model
    hf = (
        AutoConfig.from_pretrained(str(checkpoint_dir(config)))
        if m.checkpoint is not None
        else build_config(m.init_family, m.init_size)
    )
    text = _text_config(hf)
    return _ModelFacts(text.vocab_size, state_spec(hf).max_positions, hf)


# JSONL datasets that passed, by (file, size, mtime, model, settings): `longstraw train` checks
# before Prefect starts and the flow checks again at its start, in the same process.
_CHECKED_DATASETS: dict[tuple, list[int]] = {}


def check_prompts(config: RunConfig) -> list[int]:
    """The token count of every prompt of the run (a haystack run: its task length), after
    checking each against the model: ids inside the vocabulary, prompt + grpo.max_completion_length
    within max_position_embeddings. A JSONL dataset is read line by line; an error names the
    file and the line. The held-out prompts of `eval.data` are checked the same way."""
    if config.eval is not None:
        _checked_prompts(config, "eval.data")
    return _checked_prompts(config, "data")


def _checked_prompts(config: RunConfig, section: str) -> list[int]:
    """`check_prompts` of one prompt source: `data` or `eval.data`."""
    data = config.data if section == "data" else config.eval.data
    facts = _model_facts(config)
    response = config.grpo.max_completion_length
    if data.type != "jsonl":
        tokens = data.task.num_prompt_tokens
        _check_length(facts, tokens, response, f"{section}.task.num_prompt_tokens", config)
        return [tokens]
    path = Path(data.path).expanduser()
    stat = path.stat()
    key = (
        str(path.resolve()),
        stat.st_size,
        stat.st_mtime_ns,
        config.model.model_dump_json(),
        response,
        config.grpo.reward_weights is None or len(config.grpo.reward_weights),
        config.agent is not None and config.agent.model_dump_json(),
        section,
    )
    if key not in _CHECKED_DATASETS:
        _CHECKED_DATASETS[key] = _check_jsonl_prompts(config, path, facts, section)
    return _CHECKED_DATASETS[key]


def _check_length(facts: _ModelFacts, tokens: int, response: int, what: str, config) -> None:
    limit = facts.max_positions
    if limit is None or tokens + response <= limit:
        return
    model = config.model.checkpoint or f"the built {config.model.init_family} model"
    raise UserError(
        f"{what} is {tokens} tokens; with grpo.max_completion_length {response} it needs "
        f"{tokens + response} positions, but {model} supports {limit} (max_position_embeddings, "
        "no RoPE scaling) — shorten the prompt, lower grpo.max_completion_length, or use a "
        "checkpoint whose config scales RoPE (rope_type yarn)"
    )


def _check_jsonl_prompts(
    config: RunConfig, path: Path, facts: _ModelFacts, section: str = "data"
) -> list[int]:
    from longstraw.data.jsonl import DataFormatError, read_prompt_lines

    tokenizer = None
    framing = 0  # tokens the chat template adds around an agent run's prompt
    # The reward weights are the training rewards'; held-out prompts' own rewards count 1 each.
    weights = config.grpo.reward_weights if section == "data" else None
    lengths: list[int] = []
    try:
        for line, record in read_prompt_lines(path):
            where = f"{section}.path {path}:{line}: prompt {record.id!r}"
            if record.reward is not None and weights is not None and len(weights) != 1:
                raise UserError(
                    f"{where} names its own reward {record.reward!r}, but grpo.reward_weights "
                    f"has {len(weights)} weights — remove grpo.reward_weights, or the record's "
                    "'reward' (then it is scored by data.rewards)"
                )
            if record.prompt_ids is None and tokenizer is None:
                tokenizer, framing = _tokenizer_and_framing(config)
            ids = _rendered_ids(record, tokenizer, f"{section}.path {path}:{line}")
            if not ids:
                raise UserError(
                    f"{where} is empty after tokenization — give it some text, or remove the line"
                )
            low, high = min(ids), max(ids)
            if high >= facts.vocab_size:
                at = ids.index(high)
                raise UserError(
                    f"{where}: prompt_ids[{at}] is {high}, outside the vocabulary of the model "
                    f"(vocab_size {facts.vocab_size}) — tokenize the prompts with the checkpoint's "
                    "own tokenizer, or give the text as 'prompt'"
                )
            assert low >= 0, low  # PromptRecord's TokenId is >= 0
            if config.agent is not None and tokenizer is None:
                tokenizer, framing = _tokenizer_and_framing(config)
            # Chat messages are framed by the template already; an agent run adds nothing.
            tokens = len(ids) + (0 if record.messages is not None else framing)
            _check_length(facts, tokens, config.grpo.max_completion_length, where, config)
            lengths.append(tokens)
    except DataFormatError as err:
        raise UserError(
            f"{section}.path {err} — fix that line (the format: docs/data.md, one JSON object "
            "per line)"
        ) from err
    if not lengths:
        raise UserError(
            f"{section}.path {path} holds no prompts — write one JSON object per line "
            f'({{"id": ..., "prompt": ...}}, docs/data.md), or point {section}.path at another '
            "file"
        )
    return lengths


def _rendered_ids(record, tokenizer, where: str) -> list[int]:
    """[P] the record's prompt ids (`training.prompts.record_prompt_ids`); a chat template that
    cannot render its `messages` is named at the record's line."""
    from jinja2 import TemplateError

    from longstraw.training.prompts import record_prompt_ids

    try:
        return record_prompt_ids(record, tokenizer)
    except (UserError, TemplateError) as err:
        if record.messages is None:
            raise
        # LongStraw's own message ends in its fix ("...; use ..."): the fix below replaces it.
        detail = " ".join(str(err).split(";")[0].split()) or type(err).__name__
        raise UserError(
            f"{where}: field 'messages': the chat template cannot render them ({detail}) — "
            "use a checkpoint whose tokenizer has a chat template that takes these roles, or "
            "give the prompt as 'prompt' (text) or 'prompt_ids'"
        ) from err


def _tokenizer_and_framing(config: RunConfig) -> tuple[object, int]:
    """The run's tokenizer (the configured checkpoint's; the demo model is built for it) and the
    tokens an agent run's chat template adds around each prompt (0 without an agent)."""
    from transformers import AutoTokenizer

    from longstraw.training.context import initial_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(str(initial_checkpoint(config)))
    if config.agent is None:
        return tokenizer, 0
    from longstraw.data.environments import system_prompt
    from longstraw.data.trajectory import chat_prompt_ids

    system = system_prompt(config.agent.environment) if config.agent.system_prompt else None
    return tokenizer, len(chat_prompt_ids(tokenizer, [], system=system))


# What one step writes besides the arrays and the weights: JSON manifests (a few KiB per prompt
# state and per prefill shard), the rollout records, metrics rows and curves (about 20 KiB for
# the demo's step). Negligible at real scale; it keeps the estimate above a tiny run's writes.
_MANIFEST_BYTES_PER_PROMPT = 32 * 2**10
_MANIFEST_BYTES_PER_SHARD = 2 * 2**10
_RECORD_BYTES_PER_STEP = 256 * 2**10


def step_write_bytes(config: RunConfig, lengths: list[int]) -> dict[str, int]:
    """Bytes one step writes at most, by kind: the prompt states of its groups (the longest
    prompts; twice with a reference model, whose states are written once per prompt), a
    checkpoint (weights in the run's dtype, AdamW's two fp32 moments, fp32 masters of bf16
    weights, the starting checkpoint's other files; a LoRA run's adapters and their moments
    instead of the weights) and the step's records.

    `lengths`: the token count of each distinct prompt (`check_prompts`)."""
    import torch

    from longstraw.engine.layer_kinds import allocate_state_arrays
    from longstraw.engine.state import shard_bounds
    from longstraw.models.adapters import state_spec

    facts = _model_facts(config)
    spec = state_spec(facts.config)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.model.dtype]
    groups = config.train.groups_per_step
    if config.data.type != "jsonl":
        lengths = lengths * min(groups, config.data.num_prompts)  # distinct seeds, one length
    states = 0
    if config.storage.persist_mode != "off":
        for tokens in sorted(lengths, reverse=True)[:groups]:
            num_shards = len(shard_bounds(tokens - 1, config.engine.shard_tokens))
            arrays = allocate_state_arrays(
                spec,
                # One chunk per shard, the last one stored whole (Zarr pads it).
                num_tokens=num_shards * config.engine.shard_tokens,
                num_checkpoints=num_shards + 1,
                dtype=dtype,
                device="meta",
            )
            states += sum(a.numel() * a.element_size() for a in arrays.values() if a is not None)
            states += _MANIFEST_BYTES_PER_PROMPT + num_shards * _MANIFEST_BYTES_PER_SHARD
        if config.grpo.beta > 0:
            states *= 2
    params, other_files = _checkpoint_numel(config, facts)
    per_param = dtype.itemsize + 8 + (4 if dtype != torch.float32 else 0)
    if config.model.lora is not None:
        # The adapters alone, fp32 (peft keeps them so under a bf16 base), and their moments.
        model = lora_meta_model(config)
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        per_param = 4 + 8
    return {
        "prompt states": states,
        "checkpoint": params * per_param + other_files,
        "records": _RECORD_BYTES_PER_STEP,
    }


def _checkpoint_numel(config: RunConfig, facts: _ModelFacts) -> tuple[int, int]:
    """(parameters, bytes of the files beside the weights) of the run's starting checkpoint:
    from the safetensors headers of a configured one, from the config of one to be built."""
    if config.model.checkpoint is not None:
        path = checkpoint_dir(config)
        total = 0
        for file in sorted(path.glob("*.safetensors")):
            with open(file, "rb") as handle:
                (size,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(size))
            total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
        others = sum(
            f.stat().st_size for f in path.iterdir() if f.is_file() and f.suffix != ".safetensors"
        )
        return total, others
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(facts.config)
    return sum(p.numel() for p in model.parameters()), 0


def check_free_space(config: RunConfig, lengths: list[int]) -> None:
    """The local directory a step writes to has room for that step (an S3 root's prompt states
    are not counted: a bucket has no free space to ask for)."""
    from longstraw.storage.checkpoints import local_root

    writes = step_write_bytes(config, lengths)
    if not config.storage.root_uri.startswith("file://"):
        writes.pop("prompt states")  # they go to the bucket
    directory = local_root(config.storage)
    needed = sum(writes.values())
    free = shutil.disk_usage(directory).free
    if free < needed:
        parts = ", ".join(f"{name} {human_size(n)}" for name, n in writes.items() if n)
        raise UserError(
            f"{directory} has {human_size(free)} free, but one step writes about {human_size(needed)} "
            f"({parts}) — free at least {human_size(needed - free)} there, or point storage at a "
            "larger volume"
        )


def human_size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"
