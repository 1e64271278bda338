"""Background persistence (bounded, errors surface) and the process-local cache (no I/O)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bitwise_equal, make_layout, make_state, run_prefill, shard_args

from longstraw.schemas.storage import StateKey, StorageConfig
from longstraw.storage import (
    BackgroundStateWriter,
    CommittedStateLRU,
    StateKeyMismatchError,
    open_committed_state,
    open_persisting_writer,
    open_state_writer,
)
from longstraw.storage.paths import filesystem


def test_background_writer_matches_synchronous_write(root_uri):
    layout = make_layout("bfloat16")
    state = make_state(layout)
    config = StorageConfig(root_uri=root_uri, persist_mode="background", max_inflight_bytes=1000)
    w = open_persisting_writer(config, StateKey.policy("run", 1, "w", "bg"), layout)
    assert isinstance(w, BackgroundStateWriter)
    with w:
        run_prefill(w, layout, state)  # each shard is > 1000 bytes: one in flight at a time
        ref = w.commit(cache=None)
    got = open_committed_state(ref, expect_weights_digest="w", expect_policy_version=1, cache=None)
    assert_bitwise_equal(got.tensors, state)
    sync = open_persisting_writer(
        StorageConfig(root_uri=root_uri, persist_mode="synchronous"),
        StateKey.policy("run", 1, "w", "s"),
        layout,
    )
    assert not isinstance(sync, BackgroundStateWriter)
    with pytest.raises(ValueError, match="persist_mode='off'"):
        open_persisting_writer(
            StorageConfig(root_uri=root_uri, persist_mode="off"),
            StateKey.policy("r", 1, "w", "o"),
            layout,
        )


def test_background_writer_surfaces_the_first_error(tmp_path):
    layout = make_layout("float32")
    state = make_state(layout)
    inner = open_state_writer(
        StorageConfig(root_uri=str(tmp_path)), StateKey.policy("run", 1, "w", "err"), layout
    )
    w = BackgroundStateWriter(inner, max_inflight_bytes=10**9)
    w.write_shard(0, *shard_args(layout, state, 0))
    tokens, ckpts, _ = shard_args(layout, state, 1)
    w.write_shard(
        1, {n: t.double() for n, t in tokens.items()}, ckpts
    )  # wrong dtype: fails in the thread
    with pytest.raises(RuntimeError, match="background state write failed") as err:
        w.flush()
    assert "float64" in str(err.value.__cause__)
    with pytest.raises(RuntimeError, match="background state write failed"):
        w.write_shard(2, *shard_args(layout, state, 2))
    with pytest.raises(RuntimeError, match="background state write failed"):
        w.commit()
    with pytest.raises(RuntimeError, match="background state write failed"):
        w.close()


def test_committed_state_is_read_from_the_process_cache_without_io(tmp_path):
    layout = make_layout("bfloat16")
    state = make_state(layout)
    cache = CommittedStateLRU()
    w = open_state_writer(
        StorageConfig(root_uri=str(tmp_path)), StateKey.policy("run", 1, "w", "c"), layout
    )
    run_prefill(w, layout, state)
    ref = w.commit(tensors=state, cache=cache)
    fs, dir_path = filesystem(ref.uri)
    fs.rm(dir_path, recursive=True)  # any I/O would now fail
    got = open_committed_state(ref, expect_weights_digest="w", expect_policy_version=1, cache=cache)
    assert all(got.tensors[n] is state[n] for n in state), "cache hit must return the very tensors"
    with pytest.raises(StateKeyMismatchError):
        open_committed_state(ref, expect_weights_digest="w", expect_policy_version=2, cache=cache)
    with pytest.raises(FileNotFoundError):
        open_committed_state(
            ref, expect_weights_digest="w", expect_policy_version=1, cache=CommittedStateLRU()
        )


def test_cache_evicts_least_recently_used_beyond_its_byte_bound(tmp_path):
    layout = make_layout("float32", num_tokens=17, shard_tokens=16)
    state = make_state(layout)
    cache = CommittedStateLRU(max_bytes=int(layout.nbytes * 1.5))
    refs = []
    for i in range(3):
        w = open_state_writer(
            StorageConfig(root_uri=str(tmp_path)), StateKey.policy("run", 1, "w", f"e{i}"), layout
        )
        run_prefill(w, layout, state)
        refs.append(w.commit(tensors={n: t.clone() for n, t in state.items()}, cache=cache))
    assert len(cache) == 1 and cache.get(refs[2].manifest_sha256) is not None
    with pytest.raises(ValueError, match="layout says"):
        cache.put(refs[0], layout, {n: t[:1] for n, t in state.items()})
    assert torch.equal(
        cache.get(refs[2].manifest_sha256).tensors["mla/latent"], state["mla/latent"]
    )
