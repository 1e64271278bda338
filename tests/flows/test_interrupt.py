"""SIGTERM to `longstraw train` (embedded Prefect): it stops within seconds, leaves no process
behind (the ephemeral Prefect server), and prints one line naming `--resume`."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from flow_helpers import NUM_GENERATIONS, final_weights_digest, tiny_run_config, write_run_yaml

pytestmark = [pytest.mark.processes, pytest.mark.prefect, pytest.mark.slow]

FLOWS_DIR = Path(__file__).parent
REPO = FLOWS_DIR.parents[1]
EXIT_WITHIN_S = 15.0
MAX_LINES = 15
"""What a signalled run may print in all: 8 (SIGTERM to the group) and 9 (Ctrl-C) on 2 cores; a
step with more task runs in flight adds two of Prefect's "Crash detected" lines for each."""


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_LOCAL_STORAGE_PATH=str(home / "results"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
        PYTHONPATH=os.pathsep.join([str(REPO), str(FLOWS_DIR), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="2",
        # Each of step 1's reward calls sleeps (step 0's G are not delayed): the run is still
        # inside step 1 when the signal comes.
        LONGSTRAW_TEST_REWARD_DELAY_S="0.5",
        LONGSTRAW_TEST_REWARD_DELAY_AFTER_CALLS=str(NUM_GENERATIONS),
    )
    return env


def _signalled_train(
    tmp_path, runs_root, fresh_prefect_home, run_id, send, *, settle_s=0.0, cli="longstraw.cli"
):
    """Start `longstraw train` in a session of its own, wait for its first checkpoint, call
    `send(process)` and wait for the exit. Returns (return code, output, seconds from the
    signal to the exit, the children still alive `settle_s` after it, the run's directory).
    Whatever is left is killed afterwards, after the children were checked."""
    config_path = write_run_yaml(tmp_path / "run.yaml", runs_root, run_id, num_steps=3)
    first_checkpoint = runs_root / "runs" / run_id / "checkpoints" / "v000001"
    process = subprocess.Popen(
        [sys.executable, "-m", cli, "train", "--config", str(config_path)],
        cwd=tmp_path,
        env=_env(fresh_prefect_home(tmp_path / "prefect")),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group, as a shell job or a service has
    )
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while not first_checkpoint.is_dir():
            assert process.poll() is None, process.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the first step never finished"
            time.sleep(0.1)
        children = psutil.Process(process.pid).children(recursive=True)
        assert children, "expected the embedded Prefect server as a child process"
        sent = time.monotonic()
        send(process)
        output, _ = process.communicate(timeout=120)
        took = time.monotonic() - sent
        time.sleep(settle_s)
        alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for child in children:  # the server is in another session: not reached by killpg
            with contextlib.suppress(psutil.Error):
                child.kill()
    return process.returncode, output, took, alive, config_path, first_checkpoint.parent.parent


def _stopped_by_signal(rc, output, took, alive, run, signum=signal.SIGTERM) -> str:
    """Assert what every signalled run ends with; its one resume line."""
    assert took < EXIT_WITHIN_S, f"exit took {took:.1f} s\n{output[-3000:]}"
    assert rc == 128 + signum, output[-3000:]
    assert not alive, f"left behind: {[c.cmdline() for c in alive]}"
    assert not (run / "RUN.lock").exists(), "the lease was released"
    resume_lines = [line for line in output.splitlines() if "--resume" in line]
    assert len(resume_lines) == 1, output[-3000:]
    return resume_lines[0]


def test_sigterm_stops_train_leaves_no_process_and_says_how_to_resume(
    tmp_path, runs_root, fresh_prefect_home
):
    rc, output, took, alive, config_path, run = _signalled_train(
        tmp_path,
        runs_root,
        fresh_prefect_home,
        "interrupted",
        # The process only, as a supervisor would.
        lambda process: process.send_signal(signal.SIGTERM),
    )
    print(f"SIGTERM to exit: {took:.1f} s")
    resume_line = _stopped_by_signal(rc, output, took, alive, run)
    assert f"longstraw train --config {config_path} --resume" in resume_line


def test_a_cleanup_that_hangs_is_cut_short_and_still_says_how_to_resume(
    tmp_path, runs_root, fresh_prefect_home
):
    """Cleanup slower than the watchdog (a loaded machine, an endpoint that stopped answering;
    here the lease's release never returns): the process still exits with 128 + signum, stops
    what it started, removes its lease and prints the one resume line."""
    rc, output, took, alive, config_path, run = _signalled_train(
        tmp_path,
        runs_root,
        fresh_prefect_home,
        "cut-short",
        lambda process: process.send_signal(signal.SIGTERM),
        settle_s=1.0,
        cli="hanging_cleanup_cli",
    )
    print(f"SIGTERM to the forced exit: {took:.1f} s")
    resume_line = _stopped_by_signal(rc, output, took, alive, run)
    assert "interrupted by SIGTERM" in resume_line and "cut short" in resume_line
    assert f"longstraw train --config {config_path} --resume" in resume_line
    assert "took too long" not in output, output[-3000:]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_while_a_task_run_is_created_ends_as_the_interrupt(
    signum, tmp_path, runs_root, fresh_prefect_home, monkeypatch
):
    """The signal lands inside Prefect's task engine before its task run is recorded (the
    process signals itself there): the engine's crash handler raises "Task run is not set" in
    place of the interrupt, and the run still ends with 128 + signum, its resume line and none
    of the flow runs' tracebacks of that error."""
    run_id = f"task-start-{signum.name.lower()}"
    first_checkpoint = runs_root / "runs" / run_id / "checkpoints" / "v000001"
    monkeypatch.setenv("LONGSTRAW_TEST_SIGNAL", signum.name)
    monkeypatch.setenv("LONGSTRAW_TEST_SIGNAL_AFTER", str(first_checkpoint))
    rc, output, took, alive, config_path, run = _signalled_train(
        tmp_path,
        runs_root,
        fresh_prefect_home,
        run_id,
        lambda process: None,  # the process signals itself
        settle_s=1.0,
        cli="task_start_signal_cli",
    )
    resume_line = _stopped_by_signal(rc, output, took, alive, run, signum)
    assert f"interrupted by {signum.name}" in resume_line
    assert f"longstraw train --config {config_path} --resume" in resume_line
    assert "Task run is not set" not in output, output[-3000:]
    assert len(output.splitlines()) <= MAX_LINES, output[-3000:]


def test_sigterm_to_the_process_group_stops_train_as_promptly(
    tmp_path, runs_root, fresh_prefect_home, in_process_digest
):
    """What a terminal's Ctrl-C, systemd, Slurm or Kubernetes deliver: the signal to the whole
    group. The embedded Prefect server has a session of its own, so it outlives the signal long
    enough for the run to report its crash, then goes with the run. Then `--resume` ends on the
    uninterrupted run's weights."""
    rc, output, took, alive, config_path, run = _signalled_train(
        tmp_path,
        runs_root,
        fresh_prefect_home,
        "group-term",
        lambda process: os.killpg(process.pid, signal.SIGTERM),
        settle_s=1.0,  # the server's parent watch polls every second
    )
    print(f"group SIGTERM to exit: {took:.1f} s")
    _stopped_by_signal(rc, output, took, alive, run)
    # The header, Prefect's "Crash detected" line of each run in flight, the bars, the line.
    assert len(output.splitlines()) <= MAX_LINES, output[-3000:]

    # Two steps (the learning rate does not depend on the number of steps): the in-process
    # loop's uninterrupted run to compare with. Without Prefect, which the flow tests show
    # changes nothing.
    resumed = subprocess.run(
        [
            *(sys.executable, "-m", "longstraw.cli", "train", "--config", str(config_path)),
            *("--resume", "--steps", "2", "--no-prefect"),
        ],
        cwd=tmp_path,
        env=_env(tmp_path / "prefect"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    config = tiny_run_config(runs_root, "group-term", num_steps=2)
    assert final_weights_digest(config) == in_process_digest


@pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)"
)
def test_ctrl_c_in_a_terminal_stops_train_with_the_resume_line(
    tmp_path, runs_root, fresh_prefect_home
):
    """Ctrl-C typed into a terminal (tmux send-keys C-c): SIGINT to the foreground group."""
    config_path = write_run_yaml(tmp_path / "run.yaml", runs_root, "ctrl-c", num_steps=3)
    first_checkpoint = runs_root / "runs" / "ctrl-c" / "checkpoints" / "v000001"
    log, rc = tmp_path / "out.log", tmp_path / "rc"
    command = (
        f"{shlex.quote(sys.executable)} -m longstraw.cli train --config {config_path} "
        f"> {log} 2>&1; echo $? > {rc}"
    )
    tmux = ["tmux", "-L", f"longstraw-test-{os.getpid()}"]  # a private tmux server: our env
    env = _env(fresh_prefect_home(tmp_path / "prefect"))
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", "train", "-c", str(tmp_path), command],
        env=env,
        check=True,
    )
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while not first_checkpoint.is_dir():
            assert not rc.exists(), log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the first step never finished"
            time.sleep(0.1)
        pane = subprocess.run(
            [*tmux, "list-panes", "-t", "train", "-F", "#{pane_pid}"],
            capture_output=True,
            text=True,
            check=True,
        )
        children = psutil.Process(int(pane.stdout.split()[0])).children(recursive=True)
        sent = time.monotonic()
        subprocess.run([*tmux, "send-keys", "-t", "train", "C-c"], check=True)
        while not rc.exists() and time.monotonic() - sent < 60:
            time.sleep(0.1)
        took = time.monotonic() - sent
        time.sleep(1.0)  # the server's parent watch polls every second
        alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    finally:
        subprocess.run([*tmux, "kill-server"], check=False, capture_output=True)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
    output = log.read_text()
    print(f"Ctrl-C to exit: {took:.1f} s")
    assert rc.exists(), f"still running 60 s after Ctrl-C\n{output[-3000:]}"
    assert took < EXIT_WITHIN_S, f"exit took {took:.1f} s\n{output[-3000:]}"
    assert rc.read_text().strip() == str(128 + signal.SIGINT), output[-3000:]
    resume_lines = [line for line in output.splitlines() if "--resume" in line]
    assert len(resume_lines) == 1, output[-3000:]
    assert "interrupted by SIGINT" in resume_lines[0]
    assert len(output.splitlines()) <= MAX_LINES, output[-3000:]
    assert not alive, f"left behind: {[c.cmdline() for c in alive]}"
    assert not (first_checkpoint.parent.parent / "RUN.lock").exists(), "the lease was released"
