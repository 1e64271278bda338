"""`longstraw state ...`: list, inspect, verify and garbage-collect persisted prompt states.

Mounted by the main CLI with app.add_typer(state_app, name="state"). The storage modules (fsspec,
zarr, torch) are imported inside each command, so that `longstraw state --help` answers at once.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path

import typer
from rich.table import Table

from longstraw.console import cli_console, print_table
from longstraw.storage.errors import StateIntegrityError, StateNotCommittedError

state_app = typer.Typer(
    help="Persisted prompt states: ls, inspect, verify, gc.", no_args_is_help=True
)
console = cli_console()
err_console = cli_console(stderr=True)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


@state_app.command("ls")
def ls_cmd(
    root: str = typer.Argument(..., help="Storage root (path, file:// or s3:// URI)."),
) -> None:
    """Committed states and uncommitted attempts under ROOT, with sizes (and the sweep
    checkpoints of backwards in flight or killed)."""
    from longstraw.storage.gc import list_states, list_sweeps

    table = Table(title=f"prompt states under {root}")
    for col in ("state", "status", "tokens", "shards", "attempts", "size"):
        table.add_column(col, justify="right" if col in ("tokens", "shards", "size") else "left")
    for d in list_states(root):
        ident = (
            f"{d.run_id} v{d.policy_version} {d.prompt_digest}"
            if d.kind == "policy"
            else f"reference {d.weights_digest} {d.prompt_digest}"
        )
        attempts = ", ".join(
            f"{a.attempt_id[:8]}{'' if a.committed else ' (uncommitted)'} {_size(a.nbytes)}"
            for a in d.attempts.values()
        )
        table.add_row(
            ident,
            "committed" if d.committed else "[yellow]uncommitted[/yellow]",
            str(d.num_tokens or "-"),
            str(len(d.shard_manifests)),
            attempts or "-",
            _size(d.nbytes),
        )
    print_table(console, table)
    sweeps = list_sweeps(root)
    if not sweeps:
        return
    table = Table(title=f"sweep checkpoints under {root}")
    for col in ("backward", "checkpoints (shards swept)", "attempts", "size"):
        table.add_column(col, justify="right" if col == "size" else "left")
    for d in sweeps:
        attempts = ", ".join(
            f"{a.attempt_id[:8]}{'' if a.committed else ' (uncommitted)'} {_size(a.nbytes)}"
            for a in d.attempts.values()
        )
        table.add_row(
            f"{d.run_id} v{d.policy_version} {d.group}",
            ", ".join(map(str, d.committed)) or "-",
            attempts or "-",
            _size(d.nbytes),
        )
    print_table(console, table)


@state_app.command("inspect")
def inspect_cmd(
    uri: str = typer.Argument(..., help="State directory (or its COMMITTED.json)."),
) -> None:
    """The committed manifest of URI: identity, sizes, per-array shapes and dtypes."""
    from longstraw.storage.reader import read_manifest

    try:
        manifest, ref = read_manifest(uri)
    except StateNotCommittedError as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None
    head = Table(show_header=False, title=ref.uri)
    for k, v in [
        ("kind", manifest.key.kind),
        ("run", manifest.key.run_id),
        ("policy version", manifest.policy_version),
        ("weights digest", manifest.weights_digest),
        ("prompt digest", manifest.prompt_digest),
        ("tokens", manifest.num_tokens),
        ("shard tokens / shards", f"{manifest.shard_tokens} / {manifest.layout.num_shards}"),
        ("attempts", ", ".join(sorted({s.attempt_id for s in manifest.shards}))),
        ("committed by", manifest.attempt_id),
        ("code version", manifest.code_version),
        ("created", manifest.created_at.isoformat()),
        ("manifest sha256", ref.manifest_sha256),
        ("size", _size(manifest.layout.nbytes)),
    ]:
        head.add_row(k, str(v))
    print_table(console, head)
    arrays = Table(title="arrays")
    # Names never fold: they are what a user greps for and passes on.
    longest = max(len(a.name) for a in manifest.layout.arrays)
    arrays.add_column("name", no_wrap=True, min_width=longest)
    arrays.add_column("kind", no_wrap=True, min_width=len("checkpoint"))
    arrays.add_column("dtype", no_wrap=True, min_width=len("bfloat16"))
    for col in ("shape", "chunk", "chunks", "size"):
        arrays.add_column(col, overflow="fold")
    for a in manifest.layout.arrays:
        chunk = a.chunk_shape(manifest.shard_tokens)
        num_chunks = math.prod(math.ceil(s / c) for s, c in zip(a.shape, chunk, strict=True))
        arrays.add_row(
            a.name,
            a.kind,
            a.dtype,
            str(list(a.shape)),
            str(list(chunk)),
            str(num_chunks),
            _size(a.nbytes),
        )
    print_table(console, arrays)


@state_app.command("verify")
def verify_cmd(
    uri: str = typer.Argument(..., help="State directory (or its COMMITTED.json)."),
) -> None:
    """Read every chunk of URI and check its sha256 against the manifest (exit 1 on the first bad one)."""
    from longstraw.storage.reader import verify_state

    start = datetime.now(UTC)
    try:
        manifest = verify_state(uri)
    except StateNotCommittedError as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None
    except StateIntegrityError as e:
        err_console.print(f"[red]FAILED: {e}[/red]", soft_wrap=True)
        raise typer.Exit(1) from None
    num_chunks = sum(len(s.chunks) for s in manifest.shards)
    seconds = (datetime.now(UTC) - start).total_seconds()
    console.print(
        f"OK: {num_chunks} chunks, {_size(manifest.layout.nbytes)} verified in {seconds:.2f} s"
    )


@state_app.command("gc")
def gc_cmd(
    root: str = typer.Argument(..., help="Storage root (path, file:// or s3:// URI)."),
    keep_versions: int | None = typer.Option(
        None, "--keep-versions", help="Keep the newest N policy versions of each run."
    ),
    grace_seconds: float | None = typer.Option(
        None,
        "--grace-seconds",
        help="Leave uncommitted attempts touched more recently alone (default 3600).",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="List what would be removed; remove nothing."
    ),
    locks_dir: Path | None = typer.Option(
        None,
        "--locks-dir",
        help="Lock files of the prefill cache (default: $PREFECT_HOME/longstraw-locks, else "
        "./.longstraw/prefect/longstraw-locks).",
    ),
) -> None:
    """Remove uncommitted attempts (of prompt states and of sweep checkpoints) and half-written
    checkpoints (`checkpoints/v*.tmp-*`) past the grace period, states of old policy versions,
    and locks whose holder is gone."""
    from longstraw.schemas.storage import StorageConfig
    from longstraw.storage.gc import (
        collect_checkpoint_leftovers,
        collect_garbage,
        collect_stale_locks,
        default_locks_dir,
    )

    actions = collect_garbage(
        root, keep_versions=keep_versions, grace_seconds=grace_seconds, dry_run=dry_run
    )
    actions += collect_checkpoint_leftovers(
        StorageConfig(root_uri=root), grace_seconds=grace_seconds, dry_run=dry_run
    )
    actions += collect_stale_locks(locks_dir or default_locks_dir(), dry_run=dry_run)
    table = Table(title=("would remove" if dry_run else "removed") + f" ({len(actions)})")
    for col in ("path", "reason", "size"):
        table.add_column(col)
    for a in actions:
        table.add_row(a.uri, a.reason, _size(a.nbytes))
    print_table(console, table)
