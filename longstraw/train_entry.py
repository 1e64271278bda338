"""`longstraw train`: the embedded default and configured runs, with rich progress output.

With no Prefect server configured (no PREFECT_API_URL), flows run on Prefect's ephemeral local
API with a project-local PREFECT_HOME (./.longstraw/prefect), a start-up timeout long enough for
a 2-core machine and analytics off. These variables must be set before Prefect is imported.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from longstraw.console import cli_console
from longstraw.schemas.run import RunConfig
from longstraw.storage.checkpoints import latest_checkpoint
from longstraw.training.storage_faults import VOLUME_FAULTS, storage_fault

console = cli_console()


def configure_prefect_environment(project_dir: Path) -> None:
    """Embedded-default Prefect settings (only where the user has not set their own)."""
    home = project_dir / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(home))
    # Prefect's default 20 s is too short for a first start (a fresh database) on a busy machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(home / "results"))
    configure_prefect_logging(os.environ)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def configure_prefect_logging(environ) -> None:
    """Flow and task run logs (the step lines, the engine's state changes) go to the Prefect API
    at INFO, so the UI shows them; the console keeps Prefect to warnings, under rich's progress
    bars, unless the user set PREFECT_LOGGING_LEVEL themselves."""
    if "PREFECT_LOGGING_LEVEL" not in environ:
        environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
        environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    # Without these the run loggers inherit the `prefect` logger's WARNING and drop every INFO
    # line before it reaches the API handler ("This run didn't generate logs").
    environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL", "INFO")
    environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL", "INFO")


def resolve_config(
    config: RunConfig, *, config_path: Path | None, flags: Mapping[str, Any], resume: bool
) -> RunConfig:
    """The config `longstraw train` runs: `config` (the file and the flags,
    `schemas.run.command_line_config`), checked against what the run's storage already holds."""
    exists = latest_checkpoint(config.storage, config.run_id) is not None
    if exists and not resume and config_path is None and "run_id" not in flags:
        # The embedded demo never collides with an earlier demo run: give it a fresh id.
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        return config.model_copy(update={"run_id": f"{config.run_id}-{stamp}"})
    from longstraw.training.run_start import refuse_restart

    refuse_restart(config, resume)  # before Prefect and the ranks start
    return config


def summary_table(history, config: RunConfig | None = None) -> Table:
    title = "LongStraw training summary"
    if config is not None and config.model.lora is not None:
        from longstraw.training.metrics import policy_description

        title = f"{title}\n{policy_description(config, history)}"
    table = Table(title=title)
    # Short headers: the table must fit an 80-column terminal (and CI logs) untruncated.
    # "shards" is computed/reused prefill shards.
    for column in (
        "step",
        "ver",
        "reward",
        "std",
        "loss",
        "|grad|",
        "P tok",
        "shards",
        "sec",
    ):
        table.add_column(column, justify="right", no_wrap=True)
    for m in history:
        table.add_row(
            str(m.step),
            str(m.policy_version),
            f"{m.reward_mean:.3f}",
            f"{m.reward_std:.3f}",
            f"{m.loss:+.4f}",
            f"{m.grad_norm:.3f}",
            str(m.prompt_tokens),
            f"{m.shards_computed}/{m.shards_reused}",
            f"{sum(m.seconds.values()):.1f}",
        )
    return table


def run_summary(config: RunConfig, history) -> Table | str:
    """The table of the steps this call ran, or, when it ran none (a `--resume` of a finished
    run), a line that says so and how to train further."""
    if history:
        return summary_table(history, config)
    return (
        f"run {config.run_id!r} already has all {config.train.num_steps} steps: nothing to run; "
        f"pass --steps N (more than {config.train.num_steps}) with --resume to train further"
    )


class Interrupted(Exception):
    """SIGINT / SIGTERM stopped the run; the message says how to resume it."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# After a signal, cleanup (Prefect marking the run, the ranks stopping) gets this long before the
# process kills what it started and exits anyway.
FORCE_EXIT_AFTER_S = 10.0


def kill_children(timeout_s: float = 3.0) -> None:
    """Terminate, then kill, every process this one started (ranks, Prefect's server)."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(alive, timeout=timeout_s)


_said_lock = threading.Lock()
_said = [False]


def say_interrupted(line: str) -> None:
    """The interrupt's one line on stderr, written once: the unwinding run (through the CLI)
    and the watchdog race to it."""
    with _said_lock:
        if _said[0]:
            return
        _said[0] = True
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


class _Signals:
    """SIGINT / SIGTERM raise KeyboardInterrupt in the main thread (so `finally` blocks run) and
    arm a watchdog that ends the process if cleanup hangs.

    A run cut short by the watchdog is as resumable as one that unwound (checkpoints commit
    atomically), so the watchdog still releases the run's lease and says how to continue —
    `last_words(signum)`, a line that reads no storage (a frozen endpoint must not keep the
    process alive) — unless the unwinding run has said it already (`say_interrupted`)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.last_words: Callable[[int], str] | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.note(signum)
        raise KeyboardInterrupt

    def note(self, signum: int) -> None:
        """Record a signal this run was stopped by; the first one arms the watchdog."""
        first = self.received is None
        self.received = signum
        if first:
            timer = threading.Timer(FORCE_EXIT_AFTER_S, self._force_exit)
            timer.daemon = True
            timer.start()

    def _force_exit(self) -> None:
        from longstraw.training.run_lease import abandon_held_leases

        signum = self.received or signal.SIGTERM
        kill_children(timeout_s=1.0)
        # Bounded: the lease may live on a volume or endpoint that no longer answers.
        release = threading.Thread(target=abandon_held_leases, daemon=True)
        release.start()
        release.join(timeout=2.0)
        if self.last_words is None:
            say_interrupted("error: cleanup after the interrupt took too long; exited anyway")
        else:
            say_interrupted(self.last_words(signum))
        os._exit(128 + signum)

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def replaced_termination(exc: BaseException) -> int | None:
    """The signal of a Prefect `TerminationSignal` that `exc` replaced while it unwound, if any.

    Inside a flow run, Prefect's own SIGTERM handler stands in for `_Signals`: it raises
    `TerminationSignal`, and Prefect hands the signal back to the previous handler only when that
    exception reaches the flow's edge. An error raised while it unwinds (the task engine's "Task
    run is not set") replaces it there, so the signal is found only in the error's context."""
    if "prefect" not in sys.modules:
        return None
    from prefect.exceptions import TerminationSignal

    from longstraw.errors import exception_chain

    for error in exception_chain(exc):
        if isinstance(error, TerminationSignal):
            return error.signal
    return None


def resume_command(
    config: RunConfig, config_path: Path | None, run_id: str | None, root: str | None
) -> str:
    parts = ["longstraw train"]
    if config_path is not None:
        parts.append(f"--config {config_path}")
    if run_id is not None or config_path is None:
        parts.append(f"--run-id {config.run_id}")
    if root is not None:
        parts.append(f"--root {root}")
    parts.append("--resume")
    return " ".join(parts)


def run_training(
    config: RunConfig,
    *,
    config_path: Path | None,
    flags: Mapping[str, Any],
    resume: bool,
    use_prefect: bool = True,
    debug: bool = False,
) -> list:
    """Train `config` (the file at `config_path` with the command line's `flags` merged onto it:
    `schemas.run.command_line_config`, which the CLI calls before it imports torch)."""
    configure_prefect_environment(Path.cwd() / ".longstraw")
    interrupted = _Signals()
    # Registered before Prefect is imported, so it runs after Prefect's own exit hooks (LIFO):
    # Prefect flushes its logs to its server, then whatever is left (that server, ranks) goes.
    atexit.register(lambda: interrupted.received is not None and kill_children())
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = resolve_config(config, config_path=config_path, flags=flags, resume=resume)
    # What the user typed, for the line that says how to resume the run.
    run_id, root = flags.get("run_id"), flags.get("storage.root_uri")
    from longstraw.training.run_lease import run_lease
    from longstraw.training.run_start import preflight

    preflight(config, resume)
    interrupted.last_words = lambda signum: _cut_short(config, signum, config_path, run_id, root)
    with contextlib.ExitStack() as stack:
        signals = stack.enter_context(interrupted)
        # Under torchrun only rank 0 writes the run (the other ranks serve its stages).
        if int(os.environ.get("RANK", "0")) == 0:
            stack.enter_context(run_lease(config))
        try:
            with _run_on_terminal(config, use_prefect) as shown:
                if use_prefect:
                    shown.history = _train_flow(config, resume, debug, shown.server)
                else:
                    from longstraw.training.loop import train

                    shown.history = train(config, resume=resume).history
            return shown.history
        except KeyboardInterrupt:
            signum = signals.received or signal.SIGINT
            raise _interrupted(config, signum, config_path, run_id, root) from None
        except Exception as exc:
            if signals.received is None and (signum := replaced_termination(exc)) is not None:
                signals.note(signum)
            if signals.received is not None:
                # The interrupt met code that failed while it unwound: Prefect's task engine,
                # stopped between creating a task run and recording it, raises "Task run is not
                # set" from its crash handler. The user asked the run to stop; it stopped.
                raise _interrupted(config, signals.received, config_path, run_id, root) from exc
            # A fault outside the stages (the metrics, the plot, the curves) or wrapped on its way.
            fault = storage_fault(exc, config)
            if fault is None:
                raise
            fault.resume_hint = (
                f"then continue it with: {resume_command(config, config_path, run_id, root)}"
            )
            if use_prefect and fault.kind in VOLUME_FAULTS:
                from longstraw.flows.embedded_server import flush_before_volume_fault

                flush_before_volume_fault()
            if fault is exc:
                raise
            # One raised before (met again in the chain) keeps its own cause.
            raise fault from (fault.__cause__ if fault.__traceback__ is not None else exc)


def _interrupted(config: RunConfig, signum: int, config_path, run_id, root) -> Interrupted:
    """The one line a signalled run ends with: what stopped it and how to continue it."""
    return Interrupted(
        f"interrupted by {signal.Signals(signum).name}: run {config.run_id!r} stopped; its "
        f"latest committed checkpoint is {latest_checkpoint(config.storage, config.run_id)} "
        f"— continue it with: {resume_command(config, config_path, run_id, root)}",
        128 + signum,
    )


def _cut_short(config: RunConfig, signum: int, config_path, run_id, root) -> str:
    """The watchdog's line: `_interrupted`'s, without the storage read that names the latest
    checkpoint."""
    return (
        f"interrupted by {signal.Signals(signum).name}: run {config.run_id!r} stopped (its "
        f"cleanup took over {FORCE_EXIT_AFTER_S:.0f} s and was cut short; what was committed is "
        f"kept) — continue it with: {resume_command(config, config_path, run_id, root)}"
    )


class SweepBar:
    """The "sweep shards" bar: the exact reverse sweeps' shards swept / to sweep in the step
    (every group's, across replicas), with an ETA from the shards computed since the bar's clock
    started. A sweep resumed from a checkpoint starts at the shards it took (said in one line),
    which restarts the clock: they cost nothing and must not make the ETA look short."""

    def __init__(self, progress: Progress, task):
        self.progress, self.task = progress, task
        self.groups: dict[int, tuple[int, int]] = {}
        self.fresh = True
        self.lock = threading.Lock()

    def told(self, group: int, done: int, total: int, resumed: int) -> None:
        with self.lock:
            previous = self.groups.get(group)
            # A sweep that starts again (the step's next update on the same group) restarts too.
            restart = (previous is None and resumed > 0) or (
                previous is not None and done < previous[0]
            )
            self.groups[group] = (done, total)
            done_all = sum(d for d, _ in self.groups.values())
            total_all = sum(t for _, t in self.groups.values())
            if previous is None and resumed:
                self.progress.console.print(
                    f"group {group}: sweep resumed from its checkpoint after {resumed} of "
                    f"{total} shards",
                    style="dim",
                    markup=False,
                )
            if self.fresh or restart:
                self.fresh = False
                self.progress.reset(self.task, total=total_all, completed=done_all)
            # Shown while a sweep runs only: the bar of a finished step says nothing new, and a
            # run's last lines stay as they were.
            running = any(d < t for d, t in self.groups.values())
            self.progress.update(self.task, total=total_all, completed=done_all, visible=running)

    def new_step(self) -> None:
        with self.lock:
            self.groups.clear()
            self.fresh = True
            self.progress.update(self.task, visible=False)


@dataclass
class _Shown:
    """What `_run_on_terminal` holds for the run inside it."""

    server: Any = None
    """The embedded Prefect server (None: without Prefect, or the API at PREFECT_API_URL)."""
    history: list = field(default_factory=list)
    """The run's step records, set by the run: the summary is made of them."""


@contextlib.contextmanager
def _run_on_terminal(config: RunConfig, use_prefect: bool) -> Iterator[_Shown]:
    """Around a run: its first line, the embedded Prefect server (`use_prefect`), the rank group,
    the progress bars the run's events move; after it, every one of them stopped and, where it
    finished, its summary and latest checkpoint."""
    console.print(
        f"[bold]LongStraw[/bold] run [cyan]{config.run_id}[/cyan]: {config.train.num_steps} steps × "
        f"{config.train.groups_per_step} groups × G={config.grpo.num_generations}, prompt_grad="
        f"{config.engine.prompt_grad}, storage {config.storage.root_uri}"
    )
    from longstraw.models.kernels import missing_kernels_line

    if (kernels := missing_kernels_line()) is not None:
        console.print(kernels, style="dim", markup=False)
    from longstraw.distributed.stage_group import start_stage_group, stop_stage_group
    from longstraw.training import progress as events

    shown = _Shown()
    if use_prefect:
        from longstraw.flows.embedded_server import EmbeddedServer

        # Comes up while the ranks start and the flow's modules import; in a session of its own
        # (it survives the group's signal and dies with this process).
        shown.server = EmbeddedServer.start()
    # Under torchrun, every rank but 0 serves the stages from here and exits when rank 0 is done;
    # without it, rank 0 starts the other ranks on this machine.
    try:
        start_stage_group(config.parallel)
    except BaseException:
        if shown.server is not None:
            shown.server.stop()
        raise
    started = time.perf_counter()
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as progress:
        steps_bar = progress.add_task("GRPO steps", total=config.train.num_steps)
        shards_bar = progress.add_task("prefill shards", total=None)
        sweep = SweepBar(progress, progress.add_task("sweep shards", total=None, visible=False))

        def listen(event: str, fields: dict) -> None:
            if event == "prefill_shard":
                progress.update(shards_bar, total=fields["total"], completed=fields["done"])
            elif event == "sweep_shard":
                sweep.told(**fields)
            elif event == "step":
                progress.update(steps_bar, completed=fields["step"] + 1)
                sweep.new_step()
            elif event == "flow_run" and use_prefect and shown.server is None and fields["ui_url"]:
                # A server the user runs outlives this run: its page is worth opening. The
                # embedded API stops with the run and serves no UI.
                progress.console.print(f"Prefect UI: {fields['ui_url']}", markup=False)

        events.add_listener(listen)
        try:
            yield shown
        finally:
            events.remove_listener(listen)
            stop_stage_group()
            if shown.server is not None:
                shown.server.stop()
        progress.update(steps_bar, completed=config.train.num_steps)
    summary = run_summary(config, shown.history)
    # A table has its own width (and a centred title); only a line of text is kept whole.
    console.print(summary, soft_wrap=console.soft_wrap and isinstance(summary, str))
    console.print(
        f"finished in {time.perf_counter() - started:.0f} s; latest checkpoint: "
        f"{latest_checkpoint(config.storage, config.run_id)}"
    )


def _train_flow(config: RunConfig, resume: bool, debug: bool, server) -> list:
    """[steps] the run's step records, run by the Prefect flow (on `server`, the embedded API,
    or None: the one at PREFECT_API_URL)."""
    from longstraw.flows.train import train as train_flow

    if not debug:
        import logging

        from longstraw.flows.console import (
            hide_replaced_interrupts_on_console,
            hide_user_errors_on_console,
        )

        # A user error is printed once, as one line, when it reaches the CLI; so is an
        # interrupt, even when an error replaced it on its way out.
        hide_user_errors_on_console()
        hide_replaced_interrupts_on_console()
        # Prefect's log shipping then keeps quiet when the API fails (a full volume under the
        # embedded server's database): the stdlib's production setting.
        logging.raiseExceptions = False
    if server is None:
        console.print("[dim]starting Prefect (the API at PREFECT_API_URL)…[/dim]")
    else:
        console.print(f"[dim]starting Prefect (embedded local API, {server.url})…[/dim]")
        server.use()
    return train_flow(config.model_dump(mode="json"), resume=resume)
