"""The rich consoles of the CLI: a terminal wraps its own lines, a pipe or a file gets them whole.

rich breaks a long line at the console's width, 80 columns when stdout is not a terminal, and
splits a word longer than that; a path in a CI log or under `| tee` then arrives in pieces that
cannot be copied. Off a terminal, `cli_console` prints each line as one line (`soft_wrap`);
tables and progress bars keep their width.
"""

from __future__ import annotations

import sys

from rich.console import Console


def cli_console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr) that wraps lines only on a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, soft_wrap=not stream.isatty())
