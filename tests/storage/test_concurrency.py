"""Two writers of the same key: exactly one committed state, readable and not torn."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import assert_bitwise_equal, make_layout, make_state, run_prefill, shard_args

from longstraw.schemas.storage import StateKey, StorageConfig
from longstraw.storage import (
    ShardConflictError,
    StateKeyMismatchError,
    open_committed_state,
    open_state_writer,
)
from longstraw.storage.exclusive import create_exclusive
from longstraw.storage.paths import filesystem


def test_exclusive_create_has_exactly_one_winner(root_uri):
    fs, root = filesystem(root_uri)
    if not root_uri.startswith("s3://"):
        fs.makedirs(root, exist_ok=True)
    results = []
    barrier = threading.Barrier(6)

    def race(i):
        barrier.wait()
        results.append(
            (i, create_exclusive(fs, f"{root}/marker.json", f'{{"writer": {i}}}'.encode()))
        )

    threads = [threading.Thread(target=race, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in results if won]
    assert len(winners) == 1, results
    assert fs.cat_file(f"{root}/marker.json") == f'{{"writer": {winners[0]}}}'.encode()


def test_concurrent_writers_of_one_key_commit_exactly_one_state(root_uri):
    layout = make_layout("bfloat16")
    state = make_state(layout)
    config = StorageConfig(root_uri=root_uri)
    key = StateKey.policy("run", 2, "w", "shared")
    refs, errors = [], []
    barrier = threading.Barrier(2)

    def writer():
        try:
            w = open_state_writer(config, key, layout, resume=True)
            barrier.wait()
            run_prefill(w, layout, state)
            refs.append(w.commit(cache=None))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(refs) == 2 and refs[0] == refs[1], refs
    got = open_committed_state(
        refs[0], expect_weights_digest="w", expect_policy_version=2, cache=None
    )
    assert_bitwise_equal(got.tensors, state)
    fs, dir_path = filesystem(refs[0].uri)
    fs.invalidate_cache()
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(dir_path, detail=False) if p.endswith(".json")] == [
        "COMMITTED.json"
    ]


def test_writer_whose_shard_differs_from_the_recorded_one_stops(root_uri):
    layout = make_layout("float32")
    state = make_state(layout)
    config = StorageConfig(root_uri=root_uri)
    key = StateKey.policy("run", 2, "w", "diverged")
    a = open_state_writer(config, key, layout)
    b = open_state_writer(config, key, layout)  # opened before a wrote anything
    a.write_shard(0, *shard_args(layout, state, 0))
    tokens, ckpts, initial = shard_args(layout, state, 0)
    tokens = {n: t + 1 for n, t in tokens.items()}  # a nondeterministic recomputation
    with pytest.raises(ShardConflictError, match="resume=True"):
        b.write_shard(0, tokens, ckpts, initial)
    # The same bytes are adopted: b may go on extending the recorded state.
    b.write_shard(0, *shard_args(layout, state, 0))
    b.write_shard(1, *shard_args(layout, state, 1))
    with pytest.raises(ValueError, match="shard 3 written before shard 2"):
        b.write_shard(3, *shard_args(layout, state, 3))
    assert torch.equal(b.read_shard(1).token_slices["mla/latent"], state["mla/latent"][:, 16:32])


def test_writer_with_another_shard_size_is_refused(tmp_path):
    config = StorageConfig(root_uri=str(tmp_path))
    key = StateKey.policy("run", 2, "w", "sizes")
    layout = make_layout("float32")
    state = make_state(layout)
    w = open_state_writer(config, key, layout)
    w.write_shard(0, *shard_args(layout, state, 0))
    other = make_layout("float32", shard_tokens=8)
    with pytest.raises(StateKeyMismatchError, match="shard size"):
        open_state_writer(config, key, other, resume=True).read_shard(0)
