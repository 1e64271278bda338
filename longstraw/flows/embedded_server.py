"""The embedded Prefect server of `longstraw train`, in a session of its own, dying with its parent.

Prefect's own ephemeral API server is a child in the trainer's process group, so a signal to the
group (a terminal's Ctrl-C, `kill -TERM -<pgid>`, systemd, Slurm, Kubernetes) stops the server
first, and Prefect's crash reporting then retries against a dead server for minutes. Started
by `EmbeddedServer` instead, the server has a session of its own (the group's signal reaches only the trainer,
which reports the crash and stops it on exit), and a thread in the server ends it when its parent
is gone (a SIGKILLed trainer leaves no server behind).

`python -m longstraw.flows.embedded_server PARENT_PID UVICORN_ARGS...` is that server process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

PARENT_POLL_S = 1.0
"""How often the server checks that its parent lives (a dead parent's server goes within ~1 s)."""
STOP_GRACE_S = 5.0
"""After SIGTERM, how long uvicorn gets to shut down before the process exits anyway."""
FLUSH_S = 5.0
"""Longest wait for Prefect's queued logs or events to reach the API (before a volume fault's line,
and before the embedded server stops)."""


class EmbeddedServer:
    """The Prefect API `longstraw train` runs for itself when no server is configured.

    `start()` launches this module's server process on a free loopback port and returns at once;
    `use()` waits until it answers and points every Prefect client of this process at it
    (PREFECT_API_URL). Started before the model loads and the ranks start, the server comes up
    while they do, and this process never imports Prefect's server package (~4 s on 2 cores),
    which its ephemeral mode imports in every process that makes a client. `stop()` sends what
    Prefect still has queued (logs, events), then stops the server.
    """

    def __init__(self, process: subprocess.Popen, url: str) -> None:
        self.process = process
        self.url = url
        """http://127.0.0.1:PORT/api"""

    @classmethod
    def start(cls) -> EmbeddedServer | None:
        """The server, starting; None where PREFECT_API_URL names a server or ephemeral mode is
        off (Prefect then does what its settings say)."""
        import prefect
        from prefect.settings import (
            PREFECT_API_URL,
            PREFECT_SERVER_EPHEMERAL_ENABLED,
            get_current_settings,
        )

        if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
            return None
        from longstraw.distributed.launch import free_port

        port = free_port()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "longstraw.flows.embedded_server",
                str(os.getpid()),
                "--app-dir",
                str(prefect.__module_path__.parent),
                "--factory",
                "longstraw.flows.embedded_server:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "error",
                "--lifespan",
                "on",
            ],
            env={
                **os.environ,
                # What Prefect's own ephemeral start sets: no UI, an ephemeral, final server.
                "PREFECT_UI_ENABLED": "0",
                "PREFECT__SERVER_EPHEMERAL": "1",
                "PREFECT__SERVER_FINAL": "1",
                **get_current_settings().to_environment_variables(exclude_unset=True),
            },
            start_new_session=True,
        )
        return cls(process, f"http://127.0.0.1:{port}/api")

    def use(self) -> None:
        """Wait until the server answers (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, as
        Prefect's own start does), then make it this process's PREFECT_API_URL, for every thread
        (Prefect's log and event workers included)."""
        import urllib.error
        import urllib.request

        from prefect.context import refresh_global_settings_context
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

        deadline = time.monotonic() + PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
        while True:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"the embedded Prefect server exited with code {code} before it answered; "
                    "run with --no-prefect, or start a server and set PREFECT_API_URL"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"the embedded Prefect server did not answer on {self.url} within "
                        f"{PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()} s; raise "
                        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or run with --no-prefect"
                    ) from None
                time.sleep(0.1)
        os.environ["PREFECT_API_URL"] = self.url
        refresh_global_settings_context()

    def stop(self) -> None:
        """Send Prefect's queued logs and events (a few seconds at most), then stop the server
        (SIGTERM, then SIGKILL after STOP_GRACE_S)."""
        if self.process.poll() is None and os.environ.get("PREFECT_API_URL") == self.url:
            _drain_prefect_queues()
        self.process.terminate()
        try:
            self.process.wait(timeout=STOP_GRACE_S + 1)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def flush_before_volume_fault() -> None:
    """Before a run that failed on its volume (full, read-only) says so in its last line: send
    Prefect's pending logs and events now (at most a few seconds), so that what the server has
    to say about its database — on that same volume by default, `./.longstraw/prefect` — comes
    before that line, not after it at exit. Log shipping then stays quiet about failures (the
    stdlib's switch for errors inside logging, which Prefect follows)."""
    import logging

    _drain_prefect_queues()
    logging.raiseExceptions = False


def _drain_prefect_queues() -> None:
    """Send the logs and events Prefect still has queued for the API (FLUSH_S at most each)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=FLUSH_S, at_exit=False)


def create_app():
    """Prefect's server app (what `prefect.server.api.server:create_app` makes for uvicorn), with
    its console quiet about a full or read-only volume after the first line of each (the run
    says what to do; `flows.console`). Called by uvicorn once logging is set up."""
    from prefect.server.api.server import create_app as prefect_app

    from longstraw.flows.console import all_handlers, quiet_volume_faults

    app = prefect_app()
    quiet_volume_faults(all_handlers(), short=True)
    return app


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_GRACE_S)
    os._exit(1)


def main(argv: list[str]) -> None:
    parent, *uvicorn_args = argv
    threading.Thread(target=_watch_parent, args=(int(parent),), daemon=True).start()
    import uvicorn

    sys.argv = ["uvicorn", *uvicorn_args]
    uvicorn.main()


if __name__ == "__main__":
    main(sys.argv[1:])
