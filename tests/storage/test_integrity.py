"""Corrupted chunks, wrong weights or versions, and the manifests themselves."""

from __future__ import annotations

import json

import pytest
from helpers import assert_bitwise_equal, make_layout, make_state, run_prefill
from typer.testing import CliRunner

from longstraw.schemas.storage import (
    PrefixStateRef,
    ShardManifest,
    StateKey,
    StateManifest,
    StorageConfig,
)
from longstraw.storage import (
    ChunkChecksumError,
    StateIntegrityError,
    StateKeyMismatchError,
    open_committed_state,
    open_state_writer,
    verify_state,
)
from longstraw.storage.codec import chunk_key
from longstraw.storage.paths import filesystem
from longstraw.storage.state_commands import state_app


def _write(root_uri, dtype="bfloat16", version=4, prompt="p"):
    layout = make_layout(dtype)
    state = make_state(layout)
    w = open_state_writer(
        StorageConfig(root_uri=root_uri), StateKey.policy("run", version, "w", prompt), layout
    )
    run_prefill(w, layout, state)
    return w, w.commit(cache=None), state


def test_flipped_byte_is_caught_by_verify_cli_and_by_read(root_uri):
    w, ref, state = _write(root_uri)
    manifest = open_committed_state(
        ref, expect_weights_digest="w", expect_policy_version=4, cache=None
    ).manifest
    victim = manifest.shards[2].chunks[1]  # full_attention/k, second layer chunk of shard 2
    assert (victim.array, victim.index) == ("full_attention/k", (1, 2, 0, 0))
    fs, _ = filesystem(w.zarr_uri)
    path = f"{w.zarr_path}/{chunk_key(victim.array, victim.index)}"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 3] ^= 0x01
    fs.pipe_file(path, bytes(data))

    result = CliRunner().invoke(state_app, ["verify", ref.uri])
    assert result.exit_code == 1, result.output
    assert "full_attention/k" in result.output and "(1, 2, 0, 0)" in result.output, result.output
    with pytest.raises(ChunkChecksumError) as err:
        open_committed_state(ref, expect_weights_digest="w", expect_policy_version=4, cache=None)
    assert (err.value.array, err.value.index) == ("full_attention/k", (1, 2, 0, 0))
    with pytest.raises(ChunkChecksumError, match="full_attention/k"):
        verify_state(ref.uri)
    # Turned off explicitly, the read goes through and returns the corrupted bits.
    got = open_committed_state(
        ref, expect_weights_digest="w", expect_policy_version=4, cache=None, verify_checksums=False
    )
    with pytest.raises(AssertionError, match="full_attention/k: bits differ"):
        assert_bitwise_equal(got.tensors, state)


def test_verify_cli_passes_on_an_intact_state(root_uri):
    _, ref, _ = _write(root_uri)
    result = CliRunner().invoke(state_app, ["verify", ref.uri])
    assert result.exit_code == 0 and "OK" in result.output, result.output
    result = CliRunner().invoke(state_app, ["inspect", ref.uri])
    assert (
        result.exit_code == 0 and "mla/latent" in result.output and "bfloat16" in result.output
    ), result.output


def test_wrong_weights_digest_or_policy_version_is_refused(root_uri):
    _, ref, _ = _write(root_uri)
    with pytest.raises(StateKeyMismatchError, match="weights"):
        open_committed_state(ref, expect_weights_digest="other", expect_policy_version=4)
    with pytest.raises(StateKeyMismatchError, match="version"):
        open_committed_state(ref.uri, expect_weights_digest="w", expect_policy_version=5)
    assert issubclass(StateKeyMismatchError, ValueError)
    forged = PrefixStateRef(**{**ref.model_dump(), "manifest_sha256": "0" * 64})
    with pytest.raises(StateIntegrityError, match="sha256"):
        open_committed_state(forged, expect_weights_digest="w", expect_policy_version=4, cache=None)


def test_manifests_are_plain_json_that_round_trip(root_uri):
    _, ref, _ = _write(root_uri)
    fs, dir_path = filesystem(ref.uri)
    data = fs.cat_file(f"{dir_path}/COMMITTED.json")
    manifest = StateManifest.model_validate_json(data)
    assert StateManifest.model_validate(json.loads(manifest.model_dump_json())) == manifest
    assert manifest.code_version and manifest.layout.array("full_attention/k").dtype == "bfloat16"
    # 4 shards x (k: 2 layer chunks, v, latent) + 2 checkpoint arrays x 5 boundaries
    assert sum(len(s.chunks) for s in manifest.shards) == 4 * (2 + 1 + 1) + 2 * 5
    for k in range(4):
        shard = ShardManifest.model_validate_json(fs.cat_file(f"{dir_path}/shards/{k:05d}.json"))
        assert shard == manifest.shards[k]
    # Nothing on disk is a pickle: every non-chunk object is JSON.
    fs.invalidate_cache()
    for path in fs.find(dir_path):
        if "/c/" in path:
            continue
        body = fs.cat_file(path)
        assert not body.startswith(b"\x80"), f"{path} looks like a pickle"
        json.loads(body)
