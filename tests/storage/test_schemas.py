"""Storage contracts: config resolution, key validation, layout checks."""

from __future__ import annotations

import os

import pydantic
import pytest
from helpers import make_layout

from longstraw.schemas.storage import ArraySpec, StateKey, StateLayout, StorageConfig


def test_storage_config_resolves_local_roots_and_reads_the_s3_endpoint(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    config = StorageConfig()
    assert config.root_uri == f"file://{os.path.realpath(tmp_path)}/.longstraw"
    assert config.persist_mode == "background" and config.s3_endpoint_url == "http://127.0.0.1:9"
    assert StorageConfig(root_uri="s3://bucket/prefix/").root_uri == "s3://bucket/prefix"
    with pytest.raises(pydantic.ValidationError, match="use a local path"):
        StorageConfig(root_uri="gs://bucket")
    with pytest.raises(pydantic.ValidationError):
        StorageConfig(persist_mode="sometimes")
    with pytest.raises(pydantic.ValidationError):
        StorageConfig(unknown=1)


def test_state_keys_are_either_policy_or_reference():
    assert StateKey.policy("run", 3, "w", "p").policy_version == 3
    with pytest.raises(pydantic.ValidationError, match="needs run_id"):
        StateKey(kind="policy", weights_digest="w", prompt_digest="p")
    with pytest.raises(pydantic.ValidationError, match="weights_digest only"):
        StateKey(kind="reference", weights_digest="w", prompt_digest="p", policy_version=1)
    with pytest.raises(pydantic.ValidationError):
        StateKey.reference("../w", "p")  # digests become path components


def test_layout_checks_shards_and_shapes():
    layout = make_layout("bfloat16")
    assert layout.num_shards == 4 and layout.shard_range(3) == (48, 63)
    assert layout.array("full_attention/k").chunk_shape(16) == (2, 16, 2, 8)
    with pytest.raises(pydantic.ValidationError, match="num_shards"):
        StateLayout(arrays=layout.arrays, num_tokens=63, shard_tokens=16, num_shards=3)
    bad = ArraySpec(name="x", kind="checkpoint", shape=(1, 4, 2), dtype="float32")
    with pytest.raises(pydantic.ValidationError, match="S \\+ 1"):
        StateLayout.build([bad], num_tokens=63, shard_tokens=16)
    with pytest.raises(ValueError, match="outside"):
        layout.shard_range(4)
