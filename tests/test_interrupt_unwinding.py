"""A signal whose unwinding meets another error still ends in the interrupt's one line.

Prefect's task engine, stopped by the signal between creating a task run and recording it,
raises `ValueError("Task run is not set")` from its crash handler instead of letting the
KeyboardInterrupt through; the run must still stop with 128 + signum and the resume line
(seen under load: rc 1 and a Prefect traceback)."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from longstraw import train_entry
from longstraw.schemas.run import command_line_config
from longstraw.train_entry import Interrupted, run_training


def _run_training(run_id: str, tmp_path):
    """`longstraw train --steps 1 --run-id <run_id> --root <tmp>/root`, as the CLI calls it."""
    flags = {"train.num_steps": 1, "run_id": run_id, "storage.root_uri": str(tmp_path / "root")}
    config = command_line_config(None, flags)
    return run_training(config, config_path=None, flags=flags, resume=False)


def _the_run(run):
    """`train_entry._run_on_terminal` replaced: entering it runs `run(config)`, as the run inside
    it would (what it shows on the terminal is not what is tested)."""

    @contextlib.contextmanager
    def on_terminal(config, use_prefect):
        run(config)
        yield

    return on_terminal


def _signal_then_fail(unwinding_error: Exception):
    def run(config):
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises KeyboardInterrupt here
        except KeyboardInterrupt:
            raise unwinding_error from None
        raise AssertionError("the signal handler did not interrupt")

    return run


@pytest.fixture
def no_run_start(monkeypatch, tmp_path):
    from longstraw.training import run_lease, run_start

    monkeypatch.chdir(tmp_path)
    # What a real interrupt arms besides: the watchdog that exits the process after 10 s and the
    # exit hook that kills its children. Not in the test process.
    monkeypatch.setattr(train_entry._Signals, "_force_exit", lambda self: None)
    monkeypatch.setattr(train_entry.atexit, "register", lambda hook: hook)
    monkeypatch.setattr(run_start, "preflight", lambda config, resume: None)
    monkeypatch.setattr(run_lease, "run_lease", lambda config: _nothing())


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_an_error_raised_while_the_interrupt_unwinds_ends_as_the_interrupt(
    monkeypatch, tmp_path, no_run_start
):
    monkeypatch.setattr(
        train_entry,
        "_run_on_terminal",
        _the_run(_signal_then_fail(ValueError("Task run is not set"))),
    )
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as stopped:
        _run_training("unwind", tmp_path)
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert str(stopped.value).startswith("interrupted by SIGTERM: run 'unwind' stopped")
    assert "--run-id unwind" in str(stopped.value) and str(stopped.value).endswith("--resume")
    assert isinstance(stopped.value.__cause__, ValueError)  # kept for --debug, not printed
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_termination_signal_replaced_inside_a_flow_run_ends_as_the_interrupt(
    monkeypatch, tmp_path, no_run_start
):
    """Inside a flow run Prefect's SIGTERM handler stands in for ours and raises
    TerminationSignal; the task engine's error replaces it before Prefect passes the signal on,
    so our handler never runs (seen in CI: rc 1 and a Prefect traceback)."""
    from prefect.exceptions import TerminationSignal
    from prefect.utilities.engine import capture_sigterm

    def run(config):
        with capture_sigterm():  # the flow engine's bridge, as a flow run installs it
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            except TerminationSignal:
                raise ValueError("Task run is not set")  # noqa: B904 (as Prefect raises it)
        raise AssertionError("Prefect's handler did not raise TerminationSignal")

    monkeypatch.setattr(train_entry, "_run_on_terminal", _the_run(run))
    armed, note = [], train_entry._Signals.note

    def noted(self, signum):
        armed.append(signum)
        note(self, signum)

    monkeypatch.setattr(train_entry._Signals, "note", noted)
    with pytest.raises(Interrupted) as stopped:
        _run_training("bridge", tmp_path)
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert str(stopped.value).startswith("interrupted by SIGTERM: run 'bridge' stopped")
    assert armed == [signal.SIGTERM], "the watchdog and the exit hook were not armed"
    assert isinstance(stopped.value.__cause__, ValueError)


def test_an_error_without_a_signal_is_not_taken_for_an_interrupt(
    monkeypatch, tmp_path, no_run_start
):
    def fails(config):
        raise ValueError("Task run is not set")

    monkeypatch.setattr(train_entry, "_run_on_terminal", _the_run(fails))
    with pytest.raises(ValueError, match="Task run is not set"):
        _run_training("plain", tmp_path)
