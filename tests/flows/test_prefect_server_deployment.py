"""A real `prefect server` on 127.0.0.1, `prefect deploy` from prefect.yaml to a process work pool,
a worker, one run of the train deployment; its task runs and artifacts read back through the API.
Everything started here is stopped here (server and worker run in their own process groups).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from flow_helpers import NUM_SHARDS, artifacts_of, state_names, task_runs_of, tiny_run_dict

pytestmark = [pytest.mark.processes, pytest.mark.prefect, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")
POOL = "longstraw-local"
RUN_ID = "deployed"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(home: Path, api_url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_LOCAL_STORAGE_PATH=str(home / "results"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="WARNING",
        # Workers poll every 15 s by default; 1 s keeps the test short.
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_WORKER_PREFETCH_SECONDS="1",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")]),
    )
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def _start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    # setsid: a Prefect worker SIGKILLs its process group on SIGTERM (docs/design.md); its own group
    # keeps pytest out of it, and killpg stops the process with its children.
    return subprocess.Popen(
        args,
        cwd=ROOT,
        env=env,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _cli(args: list[str], env: dict) -> None:
    done = subprocess.run(
        [PREFECT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (
        f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    )


def _wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout: float = 120) -> float:
    started = time.monotonic()
    while True:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        assert time.monotonic() - started < timeout, "prefect server never became healthy"
        time.sleep(0.25)


def test_deployment_on_a_real_server_runs_through_a_process_worker(
    tmp_path, runs_root, fresh_prefect_home
):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    server_env = _env(fresh_prefect_home(tmp_path / "server-home"), None)
    client_env = _env(tmp_path / "client-home", api_url)
    server = _start(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"],
        server_env,
        tmp_path / "server.log",
    )
    worker = None
    try:
        seconds = {"server": _wait_healthy(api_url, server, tmp_path / "server.log")}
        started = time.monotonic()
        _cli(["work-pool", "create", POOL, "--type", "process"], client_env)
        _cli(
            ["--no-prompt", "deploy", "--name", "local", "--prefect-file", "prefect.yaml"],
            client_env,
        )
        seconds["deploy"] = time.monotonic() - started
        worker = _start(
            [PREFECT, "worker", "start", "--pool", POOL, "--type", "process"],
            _env(tmp_path / "worker-home", api_url),
            tmp_path / "worker.log",
        )

        started = time.monotonic()
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            # An override that names only some of `train`'s fields: `groups_per_step` and
            # `checkpoint_every` must come from the deployment's config (prefect.yaml: 1 group),
            # not from RunConfig's defaults (2 groups), as Prefect's top-level merge would give.
            overrides = tiny_run_dict(runs_root, RUN_ID, num_steps=1)
            overrides["train"] = {"num_steps": 1}
            flow_run = run_deployment(
                "longstraw-train/local",
                parameters={"config": overrides, "resume": False},
                timeout=300,
            )
            seconds["run"] = time.monotonic() - started
            assert flow_run.state.is_completed(), (
                f"{flow_run.state}\nworker log:\n{(tmp_path / 'worker.log').read_text()[-4000:]}"
            )
            runs = task_runs_of(flow_run.id)
            artifacts = {a.key: a for a in artifacts_of(flow_run.id) if a.key}
            with get_client(sync_client=True) as client:
                deployment = client.read_deployment_by_name("longstraw-train/local")
                step_runs = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(
                        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id])
                    )
                )
        print(f"seconds: {seconds}")

        assert state_names(runs, "open_run") == ["Completed"]
        assert state_names(runs, "prefill_shard") == ["Completed"] * NUM_SHARDS
        for name in ("rollout_group", "backward_group", "apply_update", "write_checkpoint"):
            assert state_names(runs, name) == ["Completed"], name
        assert {f"{RUN_ID}-metrics", f"{RUN_ID}-reward-curve", f"{RUN_ID}-step"} <= set(artifacts)
        assert (runs_root / "runs" / RUN_ID / "checkpoints" / "v000001").is_dir()
        # prefect.yaml's concurrency limit reached the server: one training run at a time.
        assert deployment.global_concurrency_limit is not None
        assert deployment.global_concurrency_limit.limit == 1
        assert deployment.concurrency_options.collision_strategy == "ENQUEUE"
        assert [r.name for r in step_runs] == [f"{RUN_ID}/step-0000"]
        # The run's config: the override's fields, the deployment's for the rest of `train`.
        trainer_state = json.loads(
            (
                runs_root / "runs" / RUN_ID / "checkpoints" / "v000001" / "trainer_state.json"
            ).read_text()
        )
        assert trainer_state["config"]["train"]["num_steps"] == 1
        assert trainer_state["config"]["train"]["groups_per_step"] == 1
        assert trainer_state["config"]["run_id"] == RUN_ID
        # The parameter schema the UI's Custom-run form is drawn from lists the config's fields.
        schema = deployment.parameter_openapi_schema
        assert schema["properties"]["config"]["anyOf"][0]["$ref"].endswith("/RunConfigOverrides")
        train_fields = schema["definitions"]["TrainConfigOverrides"]["properties"]
        assert {"num_steps", "groups_per_step", "checkpoint_every", "seed"} <= set(train_fields)
        assert (
            train_fields["num_steps"]["description"] == "Optimizer steps (policy versions) to run."
        )
        # A misspelt key is refused when the run is created, before any worker picks it up.
        with (
            temporary_settings(updates={PREFECT_API_URL: api_url}),
            pytest.raises(Exception, match="trian"),
        ):
            run_deployment("longstraw-train/local", parameters={"config": {"trian": {}}}, timeout=0)
        assert "checkpoint v1" in [r.name for r in runs]
    finally:
        if worker is not None:
            _stop(worker)
        _stop(server)
