"""Checks that fail a run in one line before anything expensive starts (Prefect, a prefill).

`preflight(config, resume)` raises `UserError` ("<what> — <fix>") for the first problem found:
the model checkpoint, `--resume` without a committed checkpoint, reward specs that do not import
or do not take `(prompt, response, metadata)`, an agent environment that does not load, a storage root that cannot be written, more ranks
than prefill shards, a missing JSONL dataset. Each check is cheap: no weights are loaded.
"""

from __future__ import annotations

import inspect
import json
import uuid
from pathlib import Path

from longstraw.errors import UserError
from longstraw.schemas.run import RunConfig

S3_CREDENTIALS = "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL_S3"


def preflight(config: RunConfig, resume: bool) -> None:
    """Raise UserError naming the first thing that would make this run fail, and its fix."""
    check_model(config)
    check_resume(config, resume)
    check_data(config)
    check_rewards(config)
    check_environment(config)
    check_world_size(config)
    check_sharded_branches(config)
    check_storage_writable(config)


def check_model(config: RunConfig) -> None:
    from longstraw.models.adapters import SUPPORTED_MODEL_TYPES

    if config.model.checkpoint is None:
        return  # built on first use (the demo)
    path = Path(config.model.checkpoint).expanduser()
    fix = (
        "point model.checkpoint at a Hugging Face checkpoint directory (config.json + safetensors)"
    )
    if not path.exists():
        raise UserError(f"model.checkpoint {path} does not exist — {fix}")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise UserError(f"model.checkpoint {path} is not a directory with a config.json — {fix}")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise UserError(
            f"model.checkpoint {path}: config.json is unreadable ({err}) — {fix}"
        ) from err
    types = {raw.get("model_type"), (raw.get("text_config") or {}).get("model_type")}
    if not types & set(SUPPORTED_MODEL_TYPES):
        raise UserError(
            f"model.checkpoint {path} is a {raw.get('model_type')!r} model, which LongStraw does not "
            f"support — use one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not any(path.glob("*.safetensors")):
        raise UserError(f"model.checkpoint {path} has no *.safetensors weights — {fix}")


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


def check_data(config: RunConfig) -> None:
    if config.data.type != "jsonl":
        return
    for field in ("path", "responses_path"):
        value = getattr(config.data, field)
        if value is not None and "://" not in value and not Path(value).expanduser().is_file():
            raise UserError(
                f"data.{field} {value} does not exist — give the path of the JSONL file "
                "(relative paths are taken from the current directory)"
            )


def check_rewards(config: RunConfig) -> None:
    from longstraw.data.rewards import register_haystack_rewards
    from longstraw.grpo.rewards import get_reward

    register_haystack_rewards()

    for spec in config.data.rewards:
        try:
            fn = get_reward(spec)
        except ValueError as err:
            what, _, fix = str(err).rpartition("; ")  # get_reward's messages end in "; <fix>"
            raise UserError(f"data.rewards: {what} — {fix}" if what else f"{err}") from err
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            continue  # a builtin or C callable: nothing to inspect
        try:
            signature.bind("prompt", "response", {})
        except TypeError as err:
            raise UserError(
                f"data.rewards: reward {spec!r} has the signature {signature}, which cannot be "
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

    if config.parallel.world_size == 1 or config.data.type != "haystack":
        return  # a JSONL prompt's length is known only once it is tokenized
    tokens = config.data.task.num_prompt_tokens
    shards = len(shard_bounds(tokens - 1, config.engine.shard_tokens))
    if config.parallel.world_size > shards:
        raise UserError(
            f"parallel.world_size {config.parallel.world_size} is more than the {shards} prefill "
            f"shards of a {tokens}-token prompt (engine.shard_tokens {config.engine.shard_tokens}) "
            "— lower parallel.world_size or engine.shard_tokens"
        )


def check_sharded_branches(config: RunConfig) -> None:
    """Segments and shared prefixes run on the ranks for every family but GLM-5's MLA layers."""
    engine = config.engine
    wanted = engine.branch_segment_tokens is not None or engine.share_response_prefixes
    if config.parallel.world_size == 1 or not wanted or config.model.checkpoint is None:
        return
    raw = json.loads((Path(config.model.checkpoint).expanduser() / "config.json").read_text())
    if raw.get("model_type") == "glm_moe_dsa":
        raise UserError(
            "engine.branch_segment_tokens / engine.share_response_prefixes do not run over a "
            "sequence-sharded GLM-5 (MLA) prompt state yet — unset them or set "
            "parallel.world_size: 1"
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
