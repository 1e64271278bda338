"""Ranks SIGKILLed inside the exact reverse sweep: on two data-parallel replicas of two sequence
ranks each, a rank killed between two sweep checkpoints, the replica's writer killed while it
commits one (every rank's part written, no marker yet), and a rank killed after the last; each
`--resume` continues the replica's sweep after its latest checkpoint, and the run ends on the
uninterrupted run's weights, optimizer rows and metrics, bitwise.

The kills land at a chosen shard through a test hook, not a timer: a `sitecustomize` that every
spawned rank imports (this test's directory first on PYTHONPATH) SIGKILLs the rank named by the
next entry of a kill list when its sweep reaches that point. The driver is this process (its
ranks spawned by `start_stage_group`), as in test_data_parallel.py. One process, killed at every
point in-process: test_sweep_resume.py.

Legend: the tiny qwen3_5 hybrid, a 64-token prompt (63 state tokens in 5 shards of 13: ranks
own shards 0-2 and 3-4), G = 3, two groups (group 0 on replica 0 = ranks 0, 1; group 1 on
replica 1 = ranks 2, 3), one step, a sweep checkpoint after every swept shard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from longstraw.distributed.stage_group import start_stage_group, stop_stage_group
from longstraw.storage.gc import list_sweeps
from longstraw.training import held, progress
from longstraw.training.loop import train
from tests.training.test_sweep_resume import (
    NUM_SHARDS,
    _config,
    _final,
    _same_bits,
    same_metrics,
)

pytestmark = [pytest.mark.slow, pytest.mark.processes]

REPO = Path(__file__).resolve().parents[2]

KILL_HOOK = """
import json, os, signal
from pathlib import Path

_KILLS = os.environ.get("LONGSTRAW_TEST_SWEEP_KILLS")


def _kill_if_next(at, group, swept):
    path = Path(_KILLS)
    kills = json.loads(path.read_text())
    here = {"at": at, "rank": int(os.environ.get("LOCAL_RANK", "0")), "group": group, "swept": swept}
    if kills and kills[0] == here:
        # Replaced whole: the other ranks read the list at every shard.
        fresh = path.with_name(f"{path.name}.{os.getpid()}")
        fresh.write_text(json.dumps(kills[1:]))
        os.replace(fresh, path)
        os.kill(os.getpid(), signal.SIGKILL)


if _KILLS:
    import longstraw.training.stages as stages
    from longstraw.storage.sweep_checkpoints import SweepCheckpointStore

    _progress = stages.sweep_progress

    def sweep_progress(group):
        told = _progress(group)

        def tell(done, total, resumed):
            _kill_if_next("progress", group, done)
            told(done, total, resumed)

        return tell

    stages.sweep_progress = sweep_progress
    _commit = SweepCheckpointStore.commit

    def commit(self, attempt_id, swept, parts, record):
        _kill_if_next("commit", self.key.group, swept)
        return _commit(self, attempt_id, swept, parts, record)

    SweepCheckpointStore.commit = commit
"""

KILLS = [
    # rank 3 (replica 1's second rank) once group 1 swept 3 shards: checkpoints 1 and 2 are
    # committed, 3 is not due yet
    {"at": "progress", "rank": 3, "group": 1, "swept": 3},
    # rank 2 (replica 1's writer) as it commits checkpoint 4: both ranks' parts are written
    {"at": "commit", "rank": 2, "group": 1, "swept": 4},
    # rank 3 after the last shard: checkpoint 4 is the last
    {"at": "progress", "rank": 3, "group": 1, "swept": 5},
]
RESUMED_FROM = [2, 3, 4]
"""The latest checkpoint of group 1 after each kill."""


def _ranks(config):
    parallel = config.parallel.model_copy(
        update={"world_size": 4, "data_parallel": 2, "backend": "gloo", "timeout_s": 120}
    )
    return config.model_copy(update={"parallel": parallel})


def test_ranks_killed_inside_the_sweep_resume_it_and_end_on_the_uninterrupted_run(
    tmp_path, checkpoint_dir, monkeypatch
):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(KILL_HOOK)
    kills = tmp_path / "kills.json"
    kills.write_text("[]")
    path = os.pathsep.join([str(tmp_path / "hook"), str(REPO), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)  # read by every rank spawned from here
    monkeypatch.setenv("LONGSTRAW_TEST_SWEEP_KILLS", str(kills))
    whole = _ranks(_config(tmp_path / "whole", checkpoint_dir("qwen3_5"), "whole"))
    killed = _ranks(_config(tmp_path / "killed", checkpoint_dir("qwen3_5"), "killed"))

    start_stage_group(whole.parallel)
    try:
        (reference,) = train(whole).history
        assert reference.grad_norm > 0, "no gradient: bitwise equality would be vacuous"
        kills.write_text(json.dumps(KILLS))
        resume = False
        for kill, latest in zip(KILLS, RESUMED_FROM, strict=True):
            with pytest.raises(Exception, match=f"rank {kill['rank']}"):
                train(killed, resume=resume)
            assert json.loads(kills.read_text()) == KILLS[KILLS.index(kill) + 1 :], "no kill"
            stop_stage_group()
            held.forget_run(killed.run_id)
            committed = {s.group: s.committed for s in list_sweeps(killed.storage.root_uri)}
            assert committed.get("g1") == [latest], (kill, committed)
            start_stage_group(killed.parallel)
            resume = True
        heard = []

        def listen(event: str, fields: dict) -> None:
            heard.append((event, fields))

        progress.add_listener(listen)
        try:
            (metrics,) = train(killed, resume=True).history
        finally:
            progress.remove_listener(listen)
    finally:
        stop_stage_group()
    # Replica 1's sweep ran on ranks 2 and 3: its progress reached this driver through the store.
    told = [fields for event, fields in heard if event == "sweep_shard" and fields["group"] == 1]
    assert told and told[-1] == {"group": 1, "done": NUM_SHARDS, "total": NUM_SHARDS, "resumed": 4}
    # Group 0 finished before the first kill (its recorded result is taken, with its counts);
    # group 1 swept only the shard after its last checkpoint.
    assert (metrics.sweep_shards_computed, metrics.sweep_shards_resumed) == (NUM_SHARDS + 1, 4)

    got, got_metrics = _final(killed)
    want, want_metrics = _final(whole)
    assert any(name.startswith("optimizer-rank3") for name in want), sorted(want)[:5]
    _same_bits(got, want)
    same_metrics(got_metrics, want_metrics, skip=frozenset({"replica_sum_bytes"}))
    assert list_sweeps(killed.storage.root_uri) == []
