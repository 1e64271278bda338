"""`longstraw` that sends itself a signal while Prefect's task engine creates a task run, once the
run's first checkpoint is committed: the moment when the task engine's crash handler raises
"Task run is not set" in place of the interrupt (its task run is not recorded yet). For
test_interrupt.py; run as `python -m task_start_signal_cli train ...` with
`LONGSTRAW_TEST_SIGNAL` (SIGTERM, SIGINT) and `LONGSTRAW_TEST_SIGNAL_AFTER`, the directory whose
appearance arms it."""

import os
import signal
from pathlib import Path

import prefect.task_engine as task_engine

_create_task_run_locally = task_engine._create_task_run_locally
_signal = signal.Signals[os.environ["LONGSTRAW_TEST_SIGNAL"]]
_armed = Path(os.environ["LONGSTRAW_TEST_SIGNAL_AFTER"])
_sent = []


def _signalled_create(*args, **kwargs):
    if not _sent and _armed.is_dir():
        _sent.append(True)
        # SIGTERM: Prefect's flow-run handler raises TerminationSignal here; SIGINT: ours raises
        # KeyboardInterrupt.
        os.kill(os.getpid(), _signal)
    return _create_task_run_locally(*args, **kwargs)


task_engine._create_task_run_locally = _signalled_create

from longstraw.cli import main  # noqa: E402

main()
