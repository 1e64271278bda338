"""Where a configured checkpoint lives: a directory, or a Hugging Face model id in the local cache.

`model.checkpoint: Qwen/Qwen3-0.6B` resolves to the snapshot directory the Hugging Face cache
holds for it (`<cache>/models--Qwen--Qwen3-0.6B/snapshots/<commit>/`, the commit `refs/main`
names), offline: the lookup never touches the network, so a run behaves the same on a machine
with and without one, and a model is downloaded once, deliberately, with `hf download`. From
then on the snapshot is an ordinary checkpoint directory (its files are links into the cache's
blobs): loaded, hashed and recorded exactly like a user's directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from longstraw.errors import UserError


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process reads: `HF_HUB_CACHE`, else the legacy
    `HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub` (`HF_HOME`: `$XDG_CACHE_HOME/huggingface`, else
    `~/.cache/huggingface`), as huggingface_hub reads them, but read at each call:
    huggingface_hub reads them once, when it is imported."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def looks_like_model_id(spec: str) -> bool:
    """Whether `spec` can name a Hub model (`name` or `org/name`, no path syntax). A path such as
    `./models/qwen`, `/models/qwen` or `~/qwen` never does."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        return False
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def resolve_checkpoint(spec: str, *, field: str = "model.checkpoint") -> Path:
    """The checkpoint directory `spec` names: an existing directory as it is, else the snapshot
    of the Hugging Face model id `spec` in the local cache (looked up offline). Raises UserError
    naming `field`, the cache searched and what to do when neither exists."""
    path = Path(spec).expanduser()
    if path.exists() or not looks_like_model_id(spec):
        return path  # a path: the checks of the caller say what is wrong with it
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        # local_files_only: read refs/main and the snapshot it names; no request is made.
        return Path(snapshot_download(spec, cache_dir=str(cache), local_files_only=True))
    except IncompleteSnapshotError as err:
        raise UserError(
            f"{field} {spec}: its snapshot in the Hugging Face cache {cache} is incomplete "
            f"({' '.join(str(err).split())[:200]}) — finish the download with `hf download "
            f"{spec}` on a machine with network access (the cache is read offline), or give a "
            "checkpoint directory"
        ) from None
    except LocalEntryNotFoundError:
        raise UserError(
            f"{field} {spec} is neither a directory nor a model in the Hugging Face cache {cache} "
            f"(HF_HUB_CACHE / HF_HOME; looked up offline) — download it into that cache with `hf "
            f"download {spec}` (`huggingface-cli download` in older huggingface_hub) on a machine "
            "with network access, or point it at a Hugging Face checkpoint directory "
            "(config.json + safetensors)"
        ) from None
