"""`longstraw train --no-prefect` with experiment trackers, SIGKILLed inside a step and resumed:
every recorded step is in every tracker exactly once, read back with the tracker's own readers.

The killed run logs to TensorBoard and MLflow; it checkpoints every 2 steps, so step 2 (logged
by then) is abandoned and run again on resume, which must not log it twice. The resumed run
adds W&B and Trackio, which must catch up with steps 0 and 1 from metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from longstraw.trackers.metric_names import tracker_metrics
from longstraw.trackers.mlflow_tracker import local_tracking_uri
from longstraw.trackers.wandb_files import history
from longstraw.training.metrics import read_metrics
from tests.training.helpers import run_config

pytestmark = pytest.mark.processes

pytest.importorskip("tensorboard", reason="pip install 'longstraw[trackers]'")
pytest.importorskip("mlflow", reason="pip install 'longstraw[trackers]'")
pytest.importorskip("wandb", reason="pip install 'longstraw[trackers]'")
pytest.importorskip("trackio", reason="pip install 'longstraw[trackers]'")

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "tracked"
NUM_STEPS = 4
NUM_GENERATIONS = 2
REWARD_DELAY_S = 60.0
"""Step 3's rewards are slow (same values), so the kill lands inside step 3, after step 2 was
logged and before step 3's checkpoint. Long, as it costs nothing (the kill ends it): at 3 s a
loaded machine's poll once saw step 2 in MLflow only after step 3 was logged too."""
STEPS = list(range(NUM_STEPS))
# Numbers that depend on the machine, not on the algorithm: a re-run step's differ.
MACHINE_PREFIXES = ("longstraw/seconds/", "longstraw/peak_rss_bytes")


def _yaml(path: Path, root: Path, checkpoint: Path, report_to: list[str]) -> Path:
    config = run_config(
        root,
        checkpoint,
        run_id=RUN_ID,
        num_steps=NUM_STEPS,
        grpo={"num_generations": NUM_GENERATIONS},
        data={"rewards": ["tests.training.helpers:checksum_reward"]},
        train={"groups_per_step": 1, "checkpoint_every": 2},
        engine={"shard_tokens": 32},
    ).model_dump(mode="json")
    config["tracking"] = {"report_to": report_to, "completions_per_step": 2}
    path.write_text(yaml.safe_dump(config))
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="2",
        **extra,
    )
    return env


def _train(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "longstraw.cli", "train", "--config", str(config), *extra]


def _mlflow_client(trackers: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=local_tracking_uri(trackers / "mlflow"))


def _mlflow_run(trackers: Path):
    client = _mlflow_client(trackers)
    experiment = client.get_experiment_by_name("longstraw")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]  # the resumed run continued it
    return client, runs[0]


def _tensorboard(trackers: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(
        str(trackers / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}
    )
    events.Reload()
    return events


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, checkpoint_dir):
    """(run directory, the steps TensorBoard and MLflow held when the first run was killed)."""
    tmp = tmp_path_factory.mktemp("trackers")
    root = tmp / "root"
    checkpoint = checkpoint_dir("llama")
    first = _yaml(tmp / "first.yaml", root, checkpoint, ["tensorboard", "mlflow"])
    run_path = root / "runs" / RUN_ID
    trackers = run_path / "trackers"
    process = subprocess.Popen(
        _train(first, "--no-prefect"),
        cwd=tmp,
        env=_env(
            LONGSTRAW_TEST_REWARD_DELAY_S=str(REWARD_DELAY_S),
            LONGSTRAW_TEST_REWARD_DELAY_AFTER_CALLS=str(3 * NUM_GENERATIONS),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        held: list[int] = []
        client = None
        # MLflow is the last tracker of the list: once it holds step 2, both do.
        while 2 not in held:
            assert process.poll() is None, process.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "step 2 never reached the trackers"
            if (trackers / "mlflow" / "run_id.json").is_file():
                run_id = json.loads((trackers / "mlflow" / "run_id.json").read_text())["id"]
                client = client or _mlflow_client(trackers)
                # The trainer may hold the store's write lock this instant: ask again.
                with contextlib.suppress(Exception):
                    held = [m.step for m in client.get_metric_history(run_id, "reward")]
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    before = {
        "tensorboard": sorted(e.step for e in _tensorboard(trackers).Scalars("reward")),
        "mlflow": held,
        "metrics.jsonl": [m.step for m in read_metrics(run_path)],
        "checkpoints": sorted(p.name for p in (run_path / "checkpoints").iterdir()),
    }
    everything = ["tensorboard", "mlflow", "wandb", "trackio"]
    resumed = subprocess.run(
        _train(
            _yaml(tmp / "resumed.yaml", root, checkpoint, everything), "--no-prefect", "--resume"
        ),
        cwd=tmp,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    # Nothing of the trackers on the console after the summary (no banner, no late exit hook).
    last = resumed.stdout.rstrip().splitlines()[-1]
    assert last.startswith("finished in "), resumed.stdout[-1500:]
    assert last.endswith(f"latest checkpoint: {root}/runs/{RUN_ID}/checkpoints/v000004"), last
    return run_path, before


def _expected(run_path: Path) -> dict[int, dict[str, float]]:
    rows = read_metrics(run_path)
    assert [m.step for m in rows] == STEPS
    return {m.step: tracker_metrics(m, agent=False) for m in rows}


def _algorithmic(values: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in values.items() if not k.startswith(MACHINE_PREFIXES)}


def test_the_kill_left_step_2_logged_but_not_checkpointed(killed_and_resumed):
    _, before = killed_and_resumed
    assert before["tensorboard"] == before["mlflow"] == [0, 1, 2]
    assert before["metrics.jsonl"] == [0, 1, 2]
    assert [name for name in before["checkpoints"] if ".tmp" not in name] == ["v000002"]


def test_tensorboard_holds_every_step_once(killed_and_resumed):
    run_path, _ = killed_and_resumed
    expected = _expected(run_path)
    events = _tensorboard(run_path / "trackers")
    assert len(list((run_path / "trackers" / "tensorboard").glob("events.out.*"))) == 2
    scalars = set(events.Tags()["scalars"])
    assert set(expected[0]) <= scalars and {"reward", "kl", "clip_ratio/low_mean"} & scalars
    for name in scalars:
        logged = events.Scalars(name)
        steps = [e.step for e in logged]
        assert steps == sorted(set(steps)), (name, steps)  # once each
        if not name.startswith(MACHINE_PREFIXES):
            for event in logged:
                # TensorBoard keeps float32.
                assert event.value == np.float32(expected[event.step][name]), (name, event.step)
    assert [e.step for e in events.Scalars("reward")] == STEPS
    texts = events.Tensors("completions/text_summary")
    assert [e.step for e in texts] == STEPS
    table = texts[0].tensor_proto.string_val[0].decode()
    assert table.splitlines()[0] == (
        "| group | prompt_id | prompt_digest | sample | completion | reward | advantage |"
    )
    assert len(table.splitlines()) == 2 + 2  # header, rule, completions_per_step rows


def test_mlflow_holds_every_step_once_in_one_run(killed_and_resumed):
    run_path, _ = killed_and_resumed
    expected = _expected(run_path)
    client, run = _mlflow_run(run_path / "trackers")
    assert run.info.run_name == RUN_ID and run.info.status == "FINISHED"
    assert set(run.data.metrics) == set(expected[0]) | set(expected[NUM_STEPS - 1])
    for name in run.data.metrics:
        logged = client.get_metric_history(run.info.run_id, name)
        steps = [m.step for m in logged]
        assert sorted(steps) == sorted(set(steps)), (name, steps)
        if not name.startswith(MACHINE_PREFIXES):
            assert {m.step: m.value for m in logged} == {
                s: v[name] for s, v in expected.items() if name in v
            }, name
    tables = client.list_artifacts(run.info.run_id, "tables/completions")
    assert [Path(t.path).name for t in tables] == [f"step_{s:06d}.json" for s in STEPS]
    table = json.loads(Path(client.download_artifacts(run.info.run_id, tables[1].path)).read_text())
    assert len(table["data"]) == 2 and table["columns"][-2:] == ["reward", "advantage"]


def test_wandb_offline_run_holds_every_step_once(killed_and_resumed):
    run_path, _ = killed_and_resumed
    expected = _expected(run_path)
    directory = run_path / "trackers" / "wandb"
    wandb_id = json.loads((directory / "run_id.json").read_text())["id"]
    # Only the resumed process logged to W&B: it caught up with steps 0 and 1.
    assert len(list((directory / "wandb").glob(f"offline-run-*-{wandb_id}"))) == 1
    rows = history(directory, wandb_id)
    assert [step for step, _ in rows] == STEPS
    for step, values in rows:
        assert values["_step"] == step
        logged = {k: v for k, v in values.items() if k in expected[step]}
        assert _algorithmic(logged) == _algorithmic(expected[step]), step
        assert values["completions/_type"] == "table-file"
        table = json.loads(
            (directory / "wandb")
            .glob(f"*{wandb_id}/files")
            .__next__()
            .joinpath(values["completions/path"])
            .read_text()
        )
        assert table["columns"][:3] == ["group", "prompt_id", "prompt_digest"]
        assert len(table["data"]) == 2


def test_trackio_holds_every_step_once(killed_and_resumed):
    run_path, _ = killed_and_resumed
    expected = _expected(run_path)
    script = (
        "import json, sys\n"
        "from trackio.sqlite_storage import SQLiteStorage\n"
        "print(json.dumps(SQLiteStorage.get_logs('longstraw', sys.argv[1])))\n"
    )
    # Trackio reads its directory (TRACKIO_DIR) once per process.
    done = subprocess.run(
        [sys.executable, "-c", script, RUN_ID],
        env={**os.environ, "TRACKIO_DIR": str(run_path / "trackers" / "trackio")},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = json.loads(done.stdout)
    assert [row["step"] for row in rows] == STEPS
    for row in rows:
        logged = {k: v for k, v in row.items() if k in expected[row["step"]]}
        assert _algorithmic(logged) == _algorithmic(expected[row["step"]])
        assert row["completions"]["_type"] == "trackio.table"
        assert len(row["completions"]["_value"]) == 2
