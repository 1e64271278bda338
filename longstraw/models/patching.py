"""Replacing a module instance's `forward` for the duration of a block."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterable, Iterator

from torch import nn


@contextlib.contextmanager
def forwards_replaced(replacements: Iterable[tuple[nn.Module, Callable]]) -> Iterator[None]:
    """Inside the block each module runs its function (bound as a method) as `forward`.

    Nested use restores what the outer block installed: the instance attribute in place before,
    or none, so that the class's `forward` shows through again.
    """
    patched = []
    for module, forward in replacements:
        patched.append((module, module.__dict__.get("forward")))
        module.forward = types.MethodType(forward, module)
    try:
        yield
    finally:
        for module, previous in reversed(patched):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
