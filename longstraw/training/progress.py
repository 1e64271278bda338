"""Progress events for a person watching (the CLI's bars): listeners in this process only.

Nothing a stage computes depends on them; they carry no data between stages.
"""

from __future__ import annotations

from collections.abc import Callable

_listeners: list[Callable[[str, dict], None]] = []


def add_listener(listener: Callable[[str, dict], None]) -> None:
    """`listener(event, fields)`: "prefill_shard" (done, total) and "step" (step)."""
    _listeners.append(listener)


def remove_listener(listener: Callable[[str, dict], None]) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def emit(event: str, **fields) -> None:
    for listener in list(_listeners):
        listener(event, fields)
