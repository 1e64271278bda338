"""Listing and garbage collection of the key space, as functions and through the CLI."""

from __future__ import annotations

import pytest
from helpers import make_layout, make_state, run_prefill, shard_args
from typer.testing import CliRunner

from longstraw.schemas.storage import StateKey, StorageConfig
from longstraw.storage import open_committed_state, open_state_writer
from longstraw.storage.gc import collect_garbage, list_states
from longstraw.storage.state_commands import state_app


def _populate(root_uri):
    layout = make_layout("bfloat16", num_tokens=33, shard_tokens=16)
    state = make_state(layout)
    config = StorageConfig(root_uri=root_uri)
    refs = {}
    for v in (1, 2, 3):
        w = open_state_writer(config, StateKey.policy("run", v, "w", "p"), layout)
        run_prefill(w, layout, state)
        refs[v] = w.commit(cache=None)
    ref_w = open_state_writer(config, StateKey.reference("refw", "p"), layout)
    run_prefill(ref_w, layout, state)
    refs["ref"] = ref_w.commit(cache=None)
    # A crashed prefill of another prompt at v3: shard 0 recorded, no commit.
    crashed = open_state_writer(config, StateKey.policy("run", 3, "w", "crashed"), layout)
    crashed.write_shard(0, *shard_args(layout, state, 0))
    return refs, crashed


def test_gc_dry_run_lists_and_gc_removes(root_uri, tmp_path):
    refs, crashed = _populate(root_uri)
    before = list_states(root_uri)
    assert [(d.kind, d.policy_version, d.prompt_digest, d.committed) for d in before] == [
        ("reference", None, "p", True),
        ("policy", 1, "p", True),
        ("policy", 2, "p", True),
        ("policy", 3, "crashed", False),
        ("policy", 3, "p", True),
    ]
    assert all(d.nbytes > 0 for d in before)

    result = CliRunner().invoke(
        state_app,
        # Its own (empty) lock folder: the default is the PREFECT_HOME other tests share.
        ["gc", root_uri, "--keep-versions", "2", "--grace-seconds", "0", "--dry-run",
         "--locks-dir", str(tmp_path / "locks")],
    )  # fmt: skip
    assert result.exit_code == 0 and "would remove (3)" in result.output, result.output
    planned = collect_garbage(root_uri, keep_versions=2, grace_seconds=0, dry_run=True)
    assert [a.uri[a.uri.index("/runs/") :] for a in planned] == [
        "/runs/run/policy-v1",
        "/runs/run/policy-v3/prompts/crashed/shards/00000.json",
        f"/runs/run/policy-v3/prompts/crashed/attempt-{crashed.attempt_id}",
    ]
    assert len(list_states(root_uri)) == len(before), "dry run removed something"

    result = CliRunner().invoke(state_app, ["ls", root_uri])
    assert result.exit_code == 0 and "uncommitted" in result.output, result.output

    # Within the grace period nothing uncommitted is touched.
    assert [a.reason for a in collect_garbage(root_uri, keep_versions=2, dry_run=True)] == [
        "policy version 1 older than the newest 2"
    ]
    removed = collect_garbage(root_uri, keep_versions=2, grace_seconds=0)
    assert len(removed) == 3
    after = list_states(root_uri)
    assert [(d.kind, d.policy_version, d.prompt_digest) for d in after] == [
        ("reference", None, "p"),
        ("policy", 2, "p"),
        ("policy", 3, "p"),
    ]
    for v in (2, 3):
        open_committed_state(
            refs[v], expect_weights_digest="w", expect_policy_version=v, cache=None
        )
    open_committed_state(
        refs["ref"], expect_weights_digest="refw", expect_policy_version=None, cache=None
    )
    with pytest.raises(FileNotFoundError):
        open_committed_state(refs[1].uri, expect_weights_digest="w", expect_policy_version=1)
    # A new writer of the crashed prompt starts clean: no stale shard manifest points at deleted chunks.
    layout = make_layout("bfloat16", num_tokens=33, shard_tokens=16)
    assert (
        open_state_writer(
            StorageConfig(root_uri=root_uri), StateKey.policy("run", 3, "w", "crashed"), layout
        ).completed_shards()
        == []
    )


def test_gc_refuses_keeping_zero_versions(tmp_path):
    with pytest.raises(ValueError, match="keep at least"):
        collect_garbage(str(tmp_path), keep_versions=0)
