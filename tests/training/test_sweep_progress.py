"""The reverse sweep's progress as a person sees it: the terminal's "sweep shards" bar (swept /
to sweep over the step's groups, an ETA whose clock restarts when a sweep resumes from a
checkpoint, shown only while a sweep runs, one line per resumed sweep), and the events of a
replica whose ranks do not include the driver, relayed through the ranks' store."""

from __future__ import annotations

import datetime
import io
import time
from types import SimpleNamespace

import torch.distributed as dist
from rich.console import Console
from rich.progress import Progress

from longstraw.distributed.launch import free_port
from longstraw.train_entry import SweepBar
from longstraw.training import progress


def _bar():
    output = io.StringIO()
    bars = Progress(console=Console(file=output, width=120), auto_refresh=False)
    bar = SweepBar(bars, bars.add_task("sweep shards", total=None, visible=False))
    return bars, bar, output


def test_the_sweep_bar_counts_every_group_and_restarts_its_clock_on_a_resumed_sweep():
    bars, bar, output = _bar()
    (task,) = bars.tasks
    bar.told(group=0, done=0, total=8, resumed=0)
    assert (task.completed, task.total, task.visible) == (0, 8, True)
    bar.told(group=0, done=3, total=8, resumed=0)
    bar.told(group=1, done=6, total=8, resumed=6)  # another replica's group resumes after 6
    assert "group 1: sweep resumed from its checkpoint after 6 of 8 shards" in output.getvalue()
    assert (task.completed, task.total) == (9, 16)
    # The 6 shards taken from the checkpoint are no speed sample: the clock restarted there.
    assert sum(sample.completed for sample in task._progress) == 0
    bar.told(group=0, done=8, total=8, resumed=0)
    assert task.visible
    bar.told(group=1, done=8, total=8, resumed=6)
    assert (task.completed, task.visible) == (16, False), "a finished step's bar is hidden"
    bar.new_step()
    bar.told(group=2, done=1, total=4, resumed=0)
    assert (task.completed, task.total, task.visible) == (1, 4, True)
    assert output.getvalue().count("resumed") == 1


def test_events_of_a_replica_elsewhere_reach_the_driver_through_the_store(monkeypatch):
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=10))
    heard = []

    def listen(event: str, fields: dict) -> None:
        heard.append((event, fields))

    progress.add_listener(listen)
    monkeypatch.setattr(progress, "RELAY_INTERVAL_S", 0.01)
    rank_2 = SimpleNamespace(store=store, is_driver=False, replicas=[0, 1])
    driver = SimpleNamespace(store=store, is_driver=True, replicas=[0, 1])
    try:
        monkeypatch.setattr(progress, "active_group", lambda: driver)
        with progress.relayed("sweep_shard", 7):
            monkeypatch.setattr(progress, "active_group", lambda: rank_2)
            for done in range(3, 6):
                progress.emit_to_driver("sweep_shard", 7, done=done, total=5, resumed=3)
                time.sleep(0.2)
            monkeypatch.setattr(progress, "active_group", lambda: driver)
    finally:
        progress.remove_listener(listen)
    assert heard == [
        ("sweep_shard", {"group": 7, "done": done, "total": 5, "resumed": 3})
        for done in range(3, 6)
    ]
    assert not store.check(["longstraw/progress/sweep_shard/7"]), "the key outlived its stage"
