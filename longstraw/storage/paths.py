"""The only place that turns a StateKey into URIs and a URI into an fsspec filesystem."""

from __future__ import annotations

import fsspec
from fsspec.core import url_to_fs

from longstraw.schemas.storage import StateKey, StorageConfig

COMMITTED_NAME = "COMMITTED.json"
SHARDS_DIR = "shards"
ZARR_NAME = "state.zarr"
ATTEMPT_PREFIX = "attempt-"


def state_dir_uri(config: StorageConfig, key: StateKey) -> str:
    """{root}/runs/{run}/policy-v{v}/prompts/{prompt} or {root}/reference/{weights}/prompts/{prompt}."""
    if key.kind == "policy":
        rel = f"runs/{key.run_id}/policy-v{key.policy_version}/prompts/{key.prompt_digest}"
    else:
        rel = f"reference/{key.weights_digest}/prompts/{key.prompt_digest}"
    return f"{config.root_uri}/{rel}"


def shard_manifest_name(k: int) -> str:
    return f"{SHARDS_DIR}/{k:05d}.json"


def attempt_dir_name(attempt_id: str) -> str:
    return f"{ATTEMPT_PREFIX}{attempt_id}"


def storage_options(uri: str, config: StorageConfig | None = None) -> dict:
    """fsspec options for a URI: the S3 endpoint from the config (or the environment)."""
    if uri.startswith("s3://"):
        endpoint = config.s3_endpoint_url if config is not None else None
        if endpoint is None:
            endpoint = StorageConfig().s3_endpoint_url
        return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    return {}


def filesystem(
    uri: str, config: StorageConfig | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path without protocol) for a URI; local paths become file:// URIs."""
    if "://" not in uri:
        uri = StorageConfig(root_uri=uri).root_uri
    fs, path = url_to_fs(uri, **storage_options(uri, config))
    return fs, path.rstrip("/")


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "s3" in protocols
