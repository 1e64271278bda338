"""Progress events for a person watching (the CLI's bars): listeners in this process only.

Nothing a stage computes depends on them; they carry no data between stages.
"""

from __future__ import annotations

from collections.abc import Callable

_listeners: list[Callable[[str, dict], None]] = []


def add_listener(listener: Callable[[str, dict], None]) -> None:
    """`listener(event, fields)`: "prefill_shard" (done, total), "step" (step), and, once at the
    start of a `longstraw-train` flow run, "flow_run" (id, ui_url: its Prefect UI page or None)."""
    _listeners.append(listener)


def remove_listener(listener: Callable[[str, dict], None]) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def emit(event: str, **fields) -> None:
    for listener in list(_listeners):
        listener(event, fields)
