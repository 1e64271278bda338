"""The rich consoles of the CLI: a terminal wraps its own lines, a pipe or a file gets them whole.

rich breaks a long line at the console's width, 80 columns when stdout is not a terminal, and
splits a word longer than that; a path in a CI log or under `| tee` then arrives in pieces that
cannot be copied. Off a terminal, `cli_console` prints each line as one line (`soft_wrap`),
and `print_table` prints a table as wide as its rows need (a path in a cell stays whole); progress
bars keep the console's width.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table


def cli_console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr) that wraps lines only on a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, soft_wrap=not stream.isatty())


_UNBOUNDED_COLUMNS = 100_000


def print_table(console: Console, table: Table) -> None:
    """`table` on `console`: at the terminal's width on a terminal, else as wide as its widest
    row, so that no cell is cut or folded (whatever COLUMNS said when the console was made)."""
    if console.is_terminal:
        console.print(table)
        return
    # measure() and print() both cap at the console's width: measure without the cap, then print
    # on a console of that width writing to the same file.
    unbounded = console.options.update(width=_UNBOUNDED_COLUMNS)
    width = max(console.width, console.measure(table, options=unbounded).maximum)
    Console(file=console.file, width=width, soft_wrap=console.soft_wrap).print(table)
