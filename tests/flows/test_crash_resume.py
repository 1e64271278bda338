"""SIGKILL `longstraw train` after a step's prompt state is committed, before its checkpoint;
`--resume` completes the run, reuses every committed shard and ends on the uninterrupted weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from flow_helpers import (
    NUM_GENERATIONS,
    NUM_SHARDS,
    final_weights_digest,
    tiny_run_config,
    write_run_yaml,
)

pytestmark = [pytest.mark.processes, pytest.mark.prefect, pytest.mark.slow]

RUN_ID = "crash"
FLOWS_DIR = Path(__file__).parent
KILL_DELAY_S = 0.3
"""Seconds between step 1's state commit and the kill. The killed run scores step 1's rewards
slowly (`LONGSTRAW_TEST_REWARD_DELAY_S`, 1 s per response, same values; step 0's G rewards are
not delayed), so the step stays open for seconds after its commit on any machine: the kill lands
inside the step, before its checkpoint, without a timing race (a fast machine finished the whole
step within 0.2 s otherwise)."""


def _train_command(config_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "longstraw.cli", "train", "--config", str(config_path), *extra]


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_LOCAL_STORAGE_PATH=str(home / "results"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
        # The tiny config's reward lives in tests/flows/flow_helpers.py.
        PYTHONPATH=os.pathsep.join([str(FLOWS_DIR), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="2",
    )
    return env


def test_sigkill_mid_step_then_resume_reuses_shards_and_matches_uninterrupted(
    tmp_path, runs_root, in_process_digest, fresh_prefect_home
):
    config = tiny_run_config(runs_root, RUN_ID, num_steps=2)
    config_path = write_run_yaml(tmp_path / "run.yaml", runs_root, RUN_ID, num_steps=2)
    run_dir = runs_root / "runs" / RUN_ID
    env = _env(fresh_prefect_home(tmp_path / "prefect"))

    process = subprocess.Popen(
        _train_command(config_path),
        cwd=tmp_path,
        env={
            **env,
            "LONGSTRAW_TEST_REWARD_DELAY_S": "1.0",
            "LONGSTRAW_TEST_REWARD_DELAY_AFTER_CALLS": str(NUM_GENERATIONS),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the ephemeral Prefect server dies with it, as on a lost node
    )
    try:
        deadline = time.monotonic() + 240
        while not list(run_dir.glob("policy-v1/prompts/*/COMMITTED.json")):
            assert process.poll() is None, process.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "step 1's prompt state was never committed"
            time.sleep(0.02)
        time.sleep(KILL_DELAY_S)
        # The embedded Prefect server has a session of its own, out of the signal's reach: it
        # must go by itself, as after a SIGKILL of the trainer alone (an OOM kill).
        children = psutil.Process(process.pid).children(recursive=True)
        commands = [" ".join(c.cmdline()) for c in children]
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    assert any("embedded_server" in command for command in commands), commands
    _, alive = psutil.wait_procs(children, timeout=5)  # it looks for its parent every second
    for child in alive:
        child.kill()
    assert not alive, f"outlived the SIGKILLed trainer: {[c.pid for c in alive]}"
    assert not (run_dir / "checkpoints" / "v000002").exists(), (
        "the kill came after step 1's checkpoint: raise LONGSTRAW_TEST_REWARD_DELAY_S"
    )
    assert (run_dir / "checkpoints" / "v000001").is_dir()

    resumed = subprocess.run(
        _train_command(config_path, "--resume"),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    # The embedded API serves no UI and stops with the run: no page is announced.
    assert "/runs/flow-run/" not in resumed.stdout, resumed.stdout

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["step"] == 1 and last["policy_version"] == 1
    # Step 1's prompt state was committed before the kill: read back, nothing recomputed.
    assert (last["shards_computed"], last["shards_reused"]) == (0, NUM_SHARDS)
    assert final_weights_digest(config) == in_process_digest
