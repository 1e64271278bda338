"""The only place that turns a StateKey into URIs and a URI into an fsspec filesystem."""

from __future__ import annotations

import fsspec
from fsspec.core import url_to_fs

from longstraw.schemas.storage import StateKey, StorageConfig
from longstraw.storage.s3_client import WatchedS3FileSystem, client_config

COMMITTED_NAME = "COMMITTED.json"
SHARDS_DIR = "shards"
ZARR_NAME = "state.zarr"
ATTEMPT_PREFIX = "attempt-"
SWEEPS_DIR = "sweeps"


def state_dir_uri(config: StorageConfig, key: StateKey) -> str:
    """{root}/runs/{run}/policy-v{v}/prompts/{prompt} or {root}/reference/{weights}/prompts/{prompt}."""
    if key.kind == "policy":
        rel = f"runs/{key.run_id}/policy-v{key.policy_version}/prompts/{key.prompt_digest}"
    else:
        rel = f"reference/{key.weights_digest}/prompts/{key.prompt_digest}"
    return f"{config.root_uri}/{rel}"


def sweep_dir_uri(config: StorageConfig, run_id: str, policy_version: int, group: int) -> str:
    """{root}/runs/{run}/policy-v{v}/sweeps/g{group}: the sweep checkpoints of one backward."""
    return f"{config.root_uri}/runs/{run_id}/policy-v{policy_version}/{SWEEPS_DIR}/g{group}"


def shard_manifest_name(k: int) -> str:
    return f"{SHARDS_DIR}/{k:05d}.json"


def attempt_dir_name(attempt_id: str) -> str:
    return f"{ATTEMPT_PREFIX}{attempt_id}"


def storage_options(uri: str, config: StorageConfig | None = None) -> dict:
    """fsspec options for a URI: the S3 endpoint from the config (or the environment), and the
    client's timeouts and retries (`storage.s3_client`)."""
    if uri.startswith("s3://"):
        defaults = StorageConfig()
        config = config or defaults
        endpoint = config.s3_endpoint_url or defaults.s3_endpoint_url
        options: dict = {
            "config_kwargs": client_config(
                config.s3_connect_timeout_s, config.s3_read_timeout_s, config.s3_max_attempts
            )
        }
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
        return options
    return {}


def filesystem(
    uri: str, config: StorageConfig | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path without protocol) for a URI; local paths become file:// URIs."""
    if "://" not in uri:
        uri = StorageConfig(root_uri=uri).root_uri
    if uri.startswith("s3://"):
        return s3_filesystem(uri, config)
    fs, path = url_to_fs(uri, **storage_options(uri, config))
    return fs, path.rstrip("/")


def s3_filesystem(
    uri: str, config: StorageConfig | None = None, *, asynchronous: bool = False
) -> tuple[WatchedS3FileSystem, str]:
    """The S3 filesystem of `uri` (instances are cached by their options, as fsspec's are)."""
    fs = WatchedS3FileSystem(asynchronous=asynchronous, **storage_options(uri, config))
    return fs, fs._strip_protocol(uri).rstrip("/")


def json_number(name: str) -> int | None:
    """k of a numbered manifest or marker named `{k:05d}.json` (a path's last part); None for
    any other name."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    if base.endswith(".json") and base[:-5].isdigit():
        return int(base[:-5])
    return None


def numbered_json(fs: fsspec.AbstractFileSystem, path: str) -> list[int]:
    """The numbers of the `{k:05d}.json` files in folder `path` now (not a cached listing),
    ascending; [] where the folder is not there."""
    fs.invalidate_cache(path)
    try:
        names = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    return sorted(k for k in map(json_number, names) if k is not None)


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "s3" in protocols
