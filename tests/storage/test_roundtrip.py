"""A persisted prompt state reads back bitwise, through our chunk reader and through zarr itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr
from helpers import assert_bitwise_equal, make_layout, make_state, run_prefill

from longstraw.schemas.storage import StateKey, StorageConfig
from longstraw.storage import naive_read_committed_state, open_committed_state, open_state_writer
from longstraw.storage.codec import chunk_key, empty_stored
from longstraw.storage.layout_io import zarr_store
from longstraw.storage.paths import filesystem


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_committed_state_round_trips_bitwise(root_uri, dtype):
    layout = make_layout(dtype)  # 63 tokens in shards of 16: last shard has 15
    state = make_state(layout)
    config = StorageConfig(root_uri=root_uri)
    key = StateKey.policy("run", 7, "weights0", "prompt0")
    with open_state_writer(config, key, layout) as w:
        assert run_prefill(w, layout, state) == [0, 1, 2, 3]
        ref = w.commit()
    assert ref.uri.endswith("/runs/run/policy-v7/prompts/prompt0")
    got = open_committed_state(
        ref, expect_weights_digest="weights0", expect_policy_version=7, cache=None
    )
    assert_bitwise_equal(got.tensors, state)
    assert got.manifest.layout == layout
    # The reference reader goes through zarr's own API and must agree.
    assert_bitwise_equal(naive_read_committed_state(ref), state)


def test_state_with_one_shard_and_a_single_token_last_shard(root_uri):
    for num_tokens, shard_tokens in [(5, 8), (33, 16)]:
        layout = make_layout("bfloat16", num_tokens=num_tokens, shard_tokens=shard_tokens)
        state = make_state(layout)
        key = StateKey.policy("run", 1, "w", f"p{num_tokens}")
        w = open_state_writer(StorageConfig(root_uri=root_uri), key, layout)
        run_prefill(w, layout, state)
        ref = w.commit()
        got = open_committed_state(
            ref, expect_weights_digest="w", expect_policy_version=1, cache=None
        )
        assert_bitwise_equal(got.tensors, state)


def test_reference_state_is_keyed_by_weights_digest(root_uri):
    layout = make_layout("float32")
    state = make_state(layout, seed=43)
    key = StateKey.reference("refweights", "prompt0")
    w = open_state_writer(StorageConfig(root_uri=root_uri), key, layout)
    run_prefill(w, layout, state)
    ref = w.commit()
    assert ref.uri.endswith("/reference/refweights/prompts/prompt0") and ref.policy_version is None
    got = open_committed_state(
        ref.uri, expect_weights_digest="refweights", expect_policy_version=None
    )
    assert_bitwise_equal(got.tensors, state)


def test_direct_chunks_match_zarr_written_chunks(root_uri):
    """Our chunk objects (written without zarr) are byte-identical to what zarr writes itself."""
    layout = make_layout("bfloat16")
    state = make_state(layout)
    w = open_state_writer(
        StorageConfig(root_uri=root_uri), StateKey.policy("r", 0, "w", "p"), layout
    )
    run_prefill(w, layout, state)
    ref = w.commit()
    fs, _ = filesystem(w.zarr_uri)
    other_uri = ref.uri + "/zarr-written.zarr"
    from longstraw.storage.layout_io import create_attempt_arrays

    create_attempt_arrays(other_uri, layout, w.config)
    store = zarr_store(other_uri)
    for a in layout.arrays:
        bits = state[a.name].contiguous()
        if a.dtype == "bfloat16":
            bits = bits.view(torch.uint16)
        # write_empty_chunks is runtime config, not metadata: without it zarr skips the all-zero
        # initial checkpoint chunk (the reason the writer does not go through zarr for chunks).
        arr = zarr.open_array(store, path=a.name, mode="r+").with_config(
            {"write_empty_chunks": True}
        )
        arr[...] = bits.numpy()
    group = zarr.open_group(store=store, mode="r")
    _, other_path = filesystem(other_uri)
    num_compared = 0
    for m in open_committed_state(
        ref, expect_weights_digest="w", expect_policy_version=0, cache=None
    ).manifest.shards:
        for d in m.chunks:
            ours = fs.cat_file(f"{w.zarr_path}/{chunk_key(d.array, d.index)}")
            theirs = fs.cat_file(f"{other_path}/{chunk_key(d.array, d.index)}")
            assert ours == theirs, f"{d.array} chunk {d.index}: {len(ours)} vs {len(theirs)} bytes"
            num_compared += 1
    assert num_compared == sum(len(m.chunks) for m in w._known.values())
    assert np.array_equal(
        np.asarray(group["mla/latent"][:]), state["mla/latent"].view(torch.uint16).numpy()
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_empty_stored_is_a_writable_c_contiguous_array_of_the_stored_dtype(dtype):
    spec = make_layout(dtype).array("full_attention/k")
    a = empty_stored(spec)
    assert (a.shape, a.dtype, a.flags.c_contiguous, a.flags.writeable) == (
        spec.shape,
        np.dtype(spec.stored_dtype),
        True,
        True,
    )
    part = empty_stored(spec, (3, 15, 2, 8))
    part[:] = 7
    assert part.shape == (3, 15, 2, 8) and int(part.sum()) == 7 * part.size
