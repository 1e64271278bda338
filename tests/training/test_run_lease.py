"""One writer per run: the run lease (`<run dir>/RUN.lock`) with real processes.

A child process holds the lease of a run; a second writer in this process and a second
`longstraw train` (a subprocess) are refused with one line naming the holder; after the holder is
SIGKILLed, its lease is taken over at once (same host: the pid is dead). The flow refuses to
restart a run that has a committed checkpoint without `resume`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from longstraw.errors import UserError
from longstraw.schemas.run import RunConfig
from longstraw.training.run_lease import RunLeaseHeld, lease_path, run_lease

REPO = Path(__file__).resolve().parents[2]

HOLDER = """
import sys, time
from longstraw.schemas.run import RunConfig
from longstraw.training.run_lease import run_lease
config = RunConfig.model_validate({"run_id": "leased", "storage": {"root_uri": sys.argv[1]}})
with run_lease(config):
    print("held", flush=True)
    time.sleep(600)
"""


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


def _config(root: Path) -> RunConfig:
    return RunConfig.model_validate({"run_id": "leased", "storage": {"root_uri": str(root)}})


@pytest.mark.processes
def test_second_writer_refused_then_dead_holders_lease_taken_over(tmp_path):
    root = tmp_path / "root"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root)], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        config = _config(root)
        assert lease_path(config).is_file()

        with pytest.raises(RunLeaseHeld) as refused, run_lease(config):
            pytest.fail("a second writer got the lease")
        message = refused.value.one_line()
        assert f"pid {holder.pid}" in message and "since" in message and "kill" in message

        # The same refusal from the CLI: one line, exit 2, before any training starts.
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "longstraw.cli",
                "train",
                "--config",
                "run.yaml",
                "--no-prefect",
            ],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert cli.returncode == 2, cli.stdout + cli.stderr
        lines = cli.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: run 'leased' is already being"), (
            lines
        )
        assert f"pid {holder.pid}" in lines[0] and "Traceback" not in cli.stderr
        assert not (root / "runs" / "leased" / "checkpoints").exists()

        holder.send_signal(signal.SIGKILL)
        holder.wait()
        started = time.monotonic()
        with run_lease(config) as path:
            took = time.monotonic() - started
            assert path.is_file()
        assert took < 1.0, f"taking over a dead holder's lease took {took:.2f} s"
        assert not lease_path(config).exists(), "the lease is released on exit"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_lease_is_reentrant_in_one_process(tmp_path):
    config = _config(tmp_path)
    with run_lease(config), run_lease(config):
        assert lease_path(config).is_file()
    assert not lease_path(config).exists()


def test_flow_refuses_to_restart_a_run_with_a_checkpoint(tmp_path):
    from longstraw.storage.checkpoints import checkpoints_dir
    from longstraw.training.run_start import refuse_restart

    config = _config(tmp_path)
    refuse_restart(config, resume=False)  # no checkpoint yet: a fresh run
    (checkpoints_dir(config.storage, config.run_id) / "v000001").mkdir(parents=True)
    refuse_restart(config, resume=True)
    with pytest.raises(UserError, match=r"already has a committed checkpoint.*resume=true"):
        refuse_restart(config, resume=False)
