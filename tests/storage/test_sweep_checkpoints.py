"""Sweep checkpoints in storage: each rank's part round-trips bitwise (local and S3), one is
committed by an exclusively created marker that retires the older ones, a damaged chunk is
named, an attempt no marker names is collected by gc, and a backward whose inputs differ, or a
checkpoint that does not read back, is named in one line and starts the sweep over."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from helpers import assert_bitwise_equal

from longstraw.schemas.storage import StorageConfig, SweepKey
from longstraw.storage.errors import ChunkChecksumError
from longstraw.storage.gc import collect_garbage, list_sweeps
from longstraw.storage.sweep_checkpoints import SweepCheckpointStore, marker_name

CHUNK = 500
"""Elements per chunk in these tests: every part spans several, some cut inside a tensor."""


class Flat:
    """A `FlatTensor` over a plain tensor."""

    def __init__(self, name: str, tensor: torch.Tensor):
        self.name, self.shape, self.tensor = name, tuple(tensor.shape), tensor

    def read(self, start: int, stop: int) -> torch.Tensor:
        return self.tensor.reshape(-1)[start:stop]

    def write(self, start: int, values: torch.Tensor) -> None:
        self.tensor.view(-1)[start : start + values.numel()] = values


def _key(**changes) -> SweepKey:
    fields = {
        "run_id": "r1",
        "policy_version": 2,
        "weights_digest": "w" * 64,
        "prompt_digest": "p" * 64,
        "num_shards": 8,
        "group": 3,
        "iteration": 0,
        "responses": "a" * 64,
        "advantages": "b" * 64,
        "loss_config": "c" * 64,
        "engine": "d" * 64,
        "model": "e" * 64,
        "placement": "2 sequence ranks",
    }
    return SweepKey(**(fields | changes))


def _tensors(rank: int, seed: int = 42) -> dict[str, torch.Tensor]:
    """A rank's odd-sized fp32 tensors (dS rows, linear cotangents, gradient rows, a 0-d one)."""
    g = torch.Generator().manual_seed(seed + rank)
    shapes = {
        "cotangent/keys/0": (37 - rank, 2, 8),
        "cotangent/conv": (2, 6, 3),
        "grad/lm_head.weight": (61, 13),
        "grad/norm.weight": (13,),
        "grad/scale": (),
    }
    out = {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
    out["cotangent/conv"][0, 0, 0] = -0.0  # the sign of a zero survives too
    return out


def _write(store: SweepCheckpointStore, swept: int, ranks: int = 2, seed: int = 42):
    attempt = store.new_attempt()
    parts = [
        store.write_part(
            attempt, r, ranks, [Flat(n, t) for n, t in _tensors(r, seed + swept).items()]
        )
        for r in range(ranks)
    ]
    return store.commit(attempt, swept, parts, {"losses": [0.5, -0.25], "swept": swept})


def _read(store: SweepCheckpointStore, manifest, rank: int) -> dict[str, torch.Tensor]:
    empty = {n: torch.full_like(t, float("nan")) for n, t in _tensors(rank).items()}
    store.read_part(manifest, rank, [Flat(n, t) for n, t in empty.items()])
    return empty


def test_each_rank_part_round_trips_bitwise_and_a_newer_checkpoint_retires_the_older(root_uri):
    store = SweepCheckpointStore(StorageConfig(root_uri=root_uri), _key(), chunk_elements=CHUNK)
    first = _write(store, swept=2)
    assert store.committed() == [2]
    latest = _write(store, swept=5)
    assert store.committed() == [5], "the older checkpoint was not retired"
    assert latest.record == {"losses": [0.5, -0.25], "swept": 5}
    assert latest.key == _key() and latest.attempt_id != first.attempt_id
    for rank in range(2):
        part = latest.parts[rank]
        assert part.num_elements == sum(math.prod(t.shape) for t in _tensors(rank).values())
        assert len(part.chunks) == math.ceil(part.num_elements / CHUNK) > 2
        assert_bitwise_equal(_read(store, latest, rank), _tensors(rank, 42 + 5))
    assert store.read_marker(5) == latest


def test_a_damaged_chunk_is_named_and_never_read_as_data(tmp_path):
    store = SweepCheckpointStore(
        StorageConfig(root_uri=str(tmp_path)), _key(), chunk_elements=CHUNK
    )
    manifest = _write(store, swept=4)
    chunk = next(
        Path(store.dir_path).glob(f"attempt-{manifest.attempt_id}/part-1-of-2.zarr/tensors/c/1")
    )
    data = bytearray(chunk.read_bytes())
    data[17] ^= 0x01
    chunk.write_bytes(bytes(data))
    with pytest.raises(ChunkChecksumError, match=r"chunk \(1,\): sha256 .* != manifest"):
        _read(store, manifest, 1)
    _read(store, manifest, 0)  # the other rank's part is intact


def test_gc_collects_an_attempt_no_marker_names_and_keeps_the_committed(tmp_path):
    config = StorageConfig(root_uri=str(tmp_path))
    store = SweepCheckpointStore(config, _key(), chunk_elements=CHUNK)
    committed = _write(store, swept=3)
    # A write killed before its marker: its part is there, no marker names it.
    orphan = store.new_attempt()
    store.write_part(orphan, 0, 2, [Flat(n, t) for n, t in _tensors(0).items()])
    (sweep,) = list_sweeps(config.root_uri)
    assert sweep.committed == [3] and sweep.group == "g3"
    assert {a: info.committed for a, info in sweep.attempts.items()} == {
        committed.attempt_id: True,
        orphan: False,
    }
    assert collect_garbage(config.root_uri, grace_seconds=3600) == [], "a live write is kept"
    actions = collect_garbage(config.root_uri, grace_seconds=0)
    assert [a.uri.rsplit("/", 1)[-1] for a in actions] == [f"attempt-{orphan}"]
    assert "uncommitted sweep checkpoint" in actions[0].reason
    (sweep,) = list_sweeps(config.root_uri)
    assert list(sweep.attempts) == [committed.attempt_id]
    assert_bitwise_equal(_read(store, committed, 1), _tensors(1, 42 + 3))


# --- in a run: the training layer's side ---------------------------------------------------------


def _run_checkpoints(tmp_path, key: SweepKey, **engine):
    from longstraw.schemas.run import RunConfig
    from longstraw.training.sweep_checkpoints import StoredSweepCheckpoints

    config = RunConfig.model_validate(
        {
            "run_id": key.run_id,
            "model": {"checkpoint": str(tmp_path / "unused")},
            "engine": engine,
            "storage": {"root_uri": str(tmp_path), "persist_mode": "synchronous"},
        }
    )
    return StoredSweepCheckpoints(config, key)


def test_a_checkpoint_of_other_inputs_is_named_in_one_line_and_the_sweep_starts_over(
    tmp_path, caplog
):
    key = _key(placement="1 process")
    written = _run_checkpoints(tmp_path, key)
    tensors = _tensors(0)
    written.save(4, [Flat(n, t) for n, t in tensors.items()], {"losses": [1.0]})
    assert written.store.committed() == [4]

    found = _run_checkpoints(tmp_path, key).latest()
    assert (found.swept, found.record) == (4, {"losses": [1.0]})
    restored = {n: torch.zeros_like(t) for n, t in tensors.items()}
    assert found.read_into([Flat(n, t) for n, t in restored.items()])
    assert_bitwise_equal(restored, tensors)

    changed = _run_checkpoints(tmp_path, _key(placement="1 process", loss_config="f" * 64))
    with caplog.at_level(logging.WARNING, logger="longstraw.sweep"):
        assert changed.latest() is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        f"warning: sweep checkpoint {written.store.dir_uri}/{marker_name(4)} is of another "
        "backward: its loss config differs (cccccccccccc… there, ffffffffffff… now); the sweep "
        "of group 3 starts over"
    )
    assert changed.store.committed() == [], "its position would block the new sweep's own"


def test_a_checkpoint_that_does_not_read_back_is_named_and_removed(tmp_path, caplog):
    key = _key(placement="1 process")
    written = _run_checkpoints(tmp_path, key)
    tensors = _tensors(0)
    written.save(2, [Flat(n, t) for n, t in tensors.items()], {})
    chunk = next(Path(written.store.dir_path).glob("attempt-*/part-0-of-1.zarr/tensors/c/0"))
    chunk.write_bytes(chunk.read_bytes()[:-4])  # truncated
    found = _run_checkpoints(tmp_path, key).latest()
    with caplog.at_level(logging.WARNING, logger="longstraw.sweep"):
        assert not found.read_into([Flat(n, torch.zeros_like(t)) for n, t in tensors.items()])
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"warning: sweep checkpoint {written.store.dir_uri}/{marker_name(2)}")
    assert "is damaged (array 'tensors' chunk (0,):" in line
    assert line.endswith("; the sweep of group 3 starts over")
    assert written.store.committed() == []


def test_checkpoints_are_due_by_shard_count_and_by_time_bounded_by_their_cost(tmp_path):
    every = _run_checkpoints(tmp_path, _key(), sweep_checkpoint_every=3)
    assert [s for s in range(1, 10) if every.due(s)] == [3, 6, 9]

    now = [0.0]
    timed = _run_checkpoints(tmp_path, _key(), sweep_checkpoint_seconds=60.0)
    timed.clock, timed.since = (lambda: now[0]), 0.0
    now[0] = 59.0
    assert not timed.due(1)
    now[0] = 60.0
    assert timed.due(2)
    # The last write took 10 s: the next waits 20 x 10 s, not 60 s (writes <= 5 % of the sweep).
    timed.since, timed.last_write_s = 60.0, 10.0
    now[0] = 60.0 + 199.0
    assert not timed.due(3)
    now[0] = 60.0 + 200.0
    assert timed.due(4)
