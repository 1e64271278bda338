"""Reading a run's YAML config from a path or a URI (file://, s3://): the deployments name one
shipped in the image, on a volume or in a bucket."""

from __future__ import annotations

from pathlib import Path

import fsspec

from longstraw.schemas.run import ConfigError, RunConfig, import_beside, parse_run_config


def read_run_config(uri: str, *layers: dict) -> RunConfig:
    """The RunConfig at `uri` with each of `layers` (overrides) merged onto it in order, field by
    field (`schemas.run.merged`)."""
    try:
        with fsspec.open(uri, "rt") as handle:
            text = handle.read()
    except FileNotFoundError as error:
        raise ConfigError(f"config file {uri} does not exist") from error
    config = parse_run_config(text, uri, *layers)
    filesystem, path = fsspec.core.url_to_fs(uri)
    protocols = filesystem.protocol
    if "file" in ((protocols,) if isinstance(protocols, str) else protocols):
        import_beside(Path(path))  # a file in a bucket has no directory to import from
    return config
