"""A writer SIGKILLed inside a shard leaves nothing readable; a resumed writer recomputes only the
missing shards and commits a state bitwise equal to an uninterrupted write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_bitwise_equal, make_layout, make_state, run_prefill

from longstraw.schemas.storage import StateKey, StorageConfig
from longstraw.storage import StateNotCommittedError, open_committed_state, open_state_writer

pytestmark = pytest.mark.processes

CHILD = Path(__file__).parent / "_writer_child.py"


def _run_child_until_inside_shard(root_uri: str, dtype: str, kill_at: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), root_uri, dtype, str(kill_at)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "IN_SHARD", (
            f"child did not reach shard {kill_at}: {line!r} {proc.stderr.read()}"
        )
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_killed_writer_leaves_no_state_and_resume_recomputes_only_missing_shards(root_uri, dtype):
    kill_at = 2  # shards 0 and 1 recorded; shard 2's chunks written but not its manifest
    _run_child_until_inside_shard(root_uri, dtype, kill_at)
    config = StorageConfig(root_uri=root_uri)
    layout = make_layout(dtype)
    state = make_state(layout)
    key = StateKey.policy("run", 1, "w", f"crash-{dtype}")

    dir_uri = open_state_writer(config, key, layout, resume=True).dir_uri
    with pytest.raises(StateNotCommittedError, match="resume"):
        open_committed_state(dir_uri, expect_weights_digest="w", expect_policy_version=1)
    with pytest.raises(ValueError, match="resume=True"):
        open_state_writer(config, key, layout)

    w = open_state_writer(config, key, layout, resume=True)
    assert w.completed_shards() == [0, 1] and w.next_shard() == 2
    written = run_prefill(w, layout, state)
    assert written == [2, 3], f"recomputed {written}, expected only the missing shards [2, 3]"
    assert w.shards_written == 2
    resumed = w.commit(cache=None)

    # Uninterrupted write of the same state under another prompt key.
    clean_key = StateKey.policy("run", 1, "w", f"clean-{dtype}")
    w2 = open_state_writer(config, clean_key, layout)
    run_prefill(w2, layout, state)
    clean = w2.commit(cache=None)

    got = open_committed_state(
        resumed, expect_weights_digest="w", expect_policy_version=1, cache=None
    )
    want = open_committed_state(
        clean, expect_weights_digest="w", expect_policy_version=1, cache=None
    )
    assert_bitwise_equal(got.tensors, want.tensors)
    assert_bitwise_equal(got.tensors, state)
    chunks = lambda m: [(d.array, d.index, d.sha256) for s in m.shards for d in s.chunks]  # noqa: E731
    assert chunks(got.manifest) == chunks(want.manifest)
    # The committed state spans two attempts: the killed one (shards 0, 1) and the resumed one.
    attempts = [s.attempt_id for s in got.manifest.shards]
    assert attempts[0] == attempts[1] != attempts[2] == attempts[3] == w.attempt_id
