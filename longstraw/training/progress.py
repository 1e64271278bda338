"""Progress events for a person watching (the CLI's bars, the Prefect UI's progress artifacts):
listeners in the driver's process.

Nothing a stage computes depends on them; they carry no data between stages. A stage that runs
on another process — a data-parallel replica whose ranks do not include the driver — hands its
events to the driver through the ranks' rendezvous store (`emit_to_driver`), and the driver
re-emits them while it waits for that stage (`relayed`).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator

from longstraw.distributed.stage_group import active_group

_listeners: list[Callable[[str, dict], None]] = []

RELAY_INTERVAL_S = 0.5
"""How often the driver looks for a remote stage's latest event (a person's eye, not a clock)."""


def add_listener(listener: Callable[[str, dict], None]) -> None:
    """`listener(event, fields)`: "prefill_shard" (done, total), "sweep_shard" (group, done,
    total, resumed: shards of that group's reverse sweep swept, taken from a checkpoint among
    them), "step" (step), and, once at the start of a `longstraw-train` flow run, "flow_run"
    (id, ui_url: its Prefect UI page or None)."""
    _listeners.append(listener)


def remove_listener(listener: Callable[[str, dict], None]) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def emit(event: str, **fields) -> None:
    for listener in list(_listeners):
        listener(event, fields)


def _relay_key(event: str, group: int) -> str:
    return f"longstraw/progress/{event}/{group}"


def emit_to_driver(event: str, group: int, **fields) -> None:
    """`emit(event, group=group, **fields)` where the driver hears it: here on the driver (or a
    single process), else as the latest value of a key in the rendezvous store that the
    driver's `relayed(event, group)` reads."""
    stage_group = active_group()
    if stage_group is None or stage_group.is_driver:
        emit(event, group=group, **fields)
        return
    stage_group.store.set(_relay_key(event, group), json.dumps(fields))


@contextlib.contextmanager
def relayed(event: str, group: int) -> Iterator[None]:
    """Inside the block (on the driver, around a stage of group `group` that may run on another
    replica's ranks) re-emit the `event`s those ranks hand over (`emit_to_driver`), each time
    the latest one changes; a no-op where no other process could send any."""
    stage_group = active_group()
    if stage_group is None or not stage_group.is_driver or not stage_group.replicas:
        yield
        return
    store, key = stage_group.store, _relay_key(event, group)
    stop = threading.Event()
    seen: list[bytes | None] = [None]

    def look() -> None:
        try:
            if store.check([key]):
                value = store.get(key)
                if value != seen[0]:
                    seen[0] = value
                    emit(event, group=group, **json.loads(value))
        except Exception:  # a store gone with the ranks: the stage says what happened
            stop.set()

    def watch() -> None:
        while not stop.wait(RELAY_INTERVAL_S):
            look()

    watcher = threading.Thread(target=watch, name=f"longstraw-relay-{group}", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        look()
        with contextlib.suppress(Exception):
            store.delete_key(key)
