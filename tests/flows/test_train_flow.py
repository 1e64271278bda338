"""The `train` flow: same weights as the in-process loop, resume, cached prefill shards, and the
audit trail the Prefect API holds for a run (run names, tags, logs, rounded curves)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from flow_helpers import (
    NUM_GENERATIONS,
    NUM_SHARDS,
    artifact_versions,
    final_weights_digest,
    flow_run_ids,
    latest_artifacts,
    logs_of,
    state_names,
    task_runs_of,
    tiny_run_config,
)

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.processes, pytest.mark.prefect, pytest.mark.slow]


def _train(config, *, resume: bool):
    from longstraw.flows.train import train

    state = train(config.model_dump(mode="json"), resume=resume, return_state=True)
    assert state.is_completed(), state
    return state.result(), state.state_details.flow_run_id


def test_train_flow_matches_in_process_loop(prefect_harness, runs_root, in_process_digest):
    # Completion texts cut to 3 characters in the UI's table (the trackers' default is 200).
    config = _completion_chars(tiny_run_config(runs_root, "flow-uninterrupted", num_steps=2), 3)
    history, flow_run_id = _train(config, resume=False)

    assert [m.step for m in history] == [0, 1]
    assert [m.policy_version for m in history] == [0, 1]
    # Both paths are deterministic on CPU and draw the same samples: bitwise the same weights.
    assert final_weights_digest(config) == in_process_digest

    artifacts = latest_artifacts(flow_run_id)
    assert {"flow-uninterrupted-metrics", "flow-uninterrupted-reward-curve"} <= set(artifacts)
    # The curves: one row per step, every float at most 4 significant digits, as recorded.
    curves = json.loads(artifacts["flow-uninterrupted-curves"].data)
    assert [row["step"] for row in curves] == [0, 1]
    for row, m in zip(curves, history, strict=True):
        for column in ("reward_mean", "reward_std", "loss", "grad_norm"):
            assert row[column] == float(f"{getattr(m, column):.4g}"), (column, row, m)
    metrics_rows = json.loads(artifacts["flow-uninterrupted-metrics"].data)
    floats = [v for row in metrics_rows for v in row.values() if isinstance(v, float)]
    assert floats and all(v == float(f"{v:.4g}") for v in floats), floats
    assert f"| 1 | 1 | {history[1].reward_mean:.4g} |" in (
        artifacts["flow-uninterrupted-reward-curve"].data
    )
    _assert_audit_trail(flow_run_id, history, run_id=config.run_id)
    cut = _assert_completions_tables(config, history)
    assert cut, "no completion longer than 3 characters: the cut was not exercised"
    _assert_reward_lines(flow_run_id, config, history)


def round4(value: float) -> float:
    """What the UI's tables show: 4 significant digits."""
    return float(f"{value:.4g}")


def _completion_chars(config, chars: int):
    tracking = config.tracking.model_copy(update={"completion_chars": chars})
    return config.model_copy(update={"tracking": tracking})


def _rollout_records(config, step: int) -> dict:
    """Prompt index -> the step's rollout record, read from its file."""
    from longstraw.schemas.refs import RolloutRecord
    from longstraw.storage.artifacts import step_dir

    paths = step_dir(config.storage, config.run_id, step).glob("rollout-g*.json")
    records = [RolloutRecord.model_validate_json(p.read_text()) for p in paths]
    return {r.prompt.index: r for r in records}


def _assert_completions_tables(config, history) -> int:
    """The UI's `<run>-completions`: one version per recorded step, oldest first, each holding
    that step's responses as its rollout records and metrics.jsonl have them. Returns how many
    texts were cut."""
    chars = config.tracking.completion_chars
    versions = artifact_versions(f"{config.run_id}-completions")
    tables = [json.loads(v.data) for v in versions]
    assert [sorted({row["step"] for row in t}) for t in tables] == [[m.step] for m in history]
    cut = 0
    for table, m in zip(tables, history, strict=True):
        records = _rollout_records(config, m.step)
        assert len(table) == min(config.tracking.completions_per_step, NUM_GENERATIONS)
        for row in table:
            record = records[row["group"]]
            text = record.texts[row["sample"]]
            expected = text if len(text) <= chars else text[: chars - 1] + "…"
            cut += expected != text
            assert row["completion"] == expected, (row, text)
            assert row["prompt_digest"] == record.prompt.prompt_digest[:12]
            assert row["reward"] == round4(record.rewards[row["sample"]]), (row, record.rewards)
        # Every response of the step's one group is in the table: its numbers are the step's.
        rewards = [r for record in records.values() for r in record.rewards]
        assert round4(sum(rewards) / len(rewards)) == round4(m.reward_mean)
        advantages = [row["advantage"] for row in table]
        assert (min(advantages), max(advantages)) == (
            round4(m.advantage_min),
            round4(m.advantage_max),
        )
    return cut


def _assert_reward_lines(flow_run_id, config, history) -> None:
    """Each rollout and backward task run logged its group's rewards (and backward its loss
    and tokens) to the Prefect API: the task run's logs in the UI."""
    import statistics

    runs = {r.id: r.name for r in task_runs_of(flow_run_id)}
    lines: dict[str, list[str]] = {}
    for log in logs_of(flow_run_id):
        if log.task_run_id in runs:
            lines.setdefault(runs[log.task_run_id], []).append(log.message)
    for m in history:
        ((index, record),) = _rollout_records(config, m.step).items()
        rewards = record.rewards
        summary = (
            f"group {index}: rewards mean {statistics.fmean(rewards):.4g} "
            f"std {statistics.stdev(rewards):.4g} min {min(rewards):.4g} "
            f"max {max(rewards):.4g} over {len(rewards)} responses"
        )
        assert summary in lines[f"rollout group {index}"], (summary, lines)
        # One group per step: its loss is the step's, its tokens the step's completion tokens.
        backward = f"{summary}; loss {m.loss:.4g} over {m.completion_tokens} tokens"
        assert backward in lines[f"backward group {index}"], (backward, lines)


def _assert_audit_trail(flow_run_id, history, run_id: str) -> None:
    """What the UI shows for the run: step flow runs, named and tagged task runs, its logs."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterTags,
    )

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run_id).name == run_id
        subflows = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=flow_run_ids(flow_run_id)[1:]))
        )
        # The Runs list filtered by `run:<id>`: the train flow run and its steps, nothing else.
        tagged = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{run_id}"]))
        )
    # Step subflows carry the run id in their names and the run and step in their tags.
    assert sorted(r.name for r in subflows) == [f"{run_id}/step-0000", f"{run_id}/step-0001"]
    for r in subflows:
        step = int(r.name.rsplit("-", 1)[1])
        assert {f"run:{run_id}", f"step:{step}", f"policy:v{step}"} <= set(r.tags), r.tags
    assert sorted(r.id for r in tagged) == sorted([flow_run_id, *(r.id for r in subflows)])

    runs = task_runs_of(flow_run_id)
    names = [r.name for r in runs]
    shard_names = [n for n in names if n.startswith("prefill s")]
    assert len(shard_names) == 2 * NUM_SHARDS, names
    assert [n.split(" group")[0] for n in shard_names[:NUM_SHARDS]] == [
        f"prefill s{i}/{NUM_SHARDS}" for i in range(NUM_SHARDS)
    ]
    # One group per step, numbered run-wide by its prompt: the same number in every stage.
    for step in (0, 1):
        for stage in ("prefill s0/3 group", "rollout group", "backward group"):
            assert any(n.startswith(f"{stage} {step}") for n in names), (stage, step, names)
    for expected in ("checkpoint v1", "checkpoint v2"):
        assert expected in names, (expected, names)
    # Tags: the run, the stage, the policy version the step ran at (and `gpu` on model tasks).
    backward = [set(r.tags) for r in runs if r.name.startswith("backward group ")]
    assert len(backward) == 2, names
    for step, tags in enumerate(backward):
        assert {f"run:{run_id}", "stage:backward", f"step:{step}", f"policy:v{step}", "gpu"} <= tags
    checkpoint = next(set(r.tags) for r in runs if r.name == "checkpoint v2")
    assert {f"run:{run_id}", "stage:checkpoint", "step:1", "policy:v1"} <= checkpoint
    assert "gpu" not in checkpoint

    # The step lines and each shard's cache key reached the API (the run's logs in the UI).
    messages = [log.message for log in logs_of(flow_run_id)]
    for m in history:
        assert any(msg.startswith(f"step {m.step}: reward {m.reward_mean:.3f}") for msg in messages)
    keys = [msg for msg in messages if ": cache key prefill_shard-" in msg]
    assert len(keys) == 2 * NUM_SHARDS, messages
    # Prefect's lines around the hook that logs the key are DEBUG, not in the run's INFO logs.
    assert not [msg for msg in messages if "hook 'log_cache_key'" in msg.lower()], messages
    assert all(f"prefill_shard-{run_id}-" in k for k in keys), keys
    # The digest a shard's name shows is the one its cache key holds.
    shard = next(r for r in runs if r.name.startswith("prefill s0/"))
    assert shard.name.rsplit(" ", 1)[1] in keys[0], (shard.name, keys[0])


def test_zombie_flow_automation_is_accepted_by_the_prefect_api(prefect_harness):
    from prefect import get_client
    from prefect.events.schemas.automations import AutomationCore

    path = ROOT / "infra" / "prefect-automation-crash-zombie-flows.yaml"
    spec = AutomationCore.model_validate(yaml.safe_load(path.read_text()))
    with get_client(sync_client=True) as client:
        automation = client.read_automation(client.create_automation(spec))
        try:
            assert automation.trigger.after == {"prefect.flow-run.heartbeat"}
            assert "prefect.flow-run.Crashed" in automation.trigger.expect
            assert automation.trigger.posture == "Proactive"
            assert [a.type for a in automation.actions] == ["change-flow-run-state"]
            assert automation.actions[0].state.value == "CRASHED"
        finally:
            client.delete_automation(automation.id)


def test_resumed_train_flow_matches_uninterrupted_and_reuses_committed_shards(
    prefect_harness, runs_root, in_process_digest
):
    # A 1-step run, then a resumed run to 2 steps (the learning rate is constant, so the
    # optimizer trajectory does not depend on num_steps). They log to TensorBoard.
    first, _ = _train(_tensorboard(tiny_run_config(runs_root, "flow-resumed", 1)), resume=False)
    assert [m.step for m in first] == [0]
    config = _tensorboard(tiny_run_config(runs_root, "flow-resumed", num_steps=2))
    second, _ = _train(config, resume=True)
    assert [m.step for m in second] == [1]
    assert (second[0].shards_computed, second[0].shards_reused) == (NUM_SHARDS, 0)
    assert final_weights_digest(config) == in_process_digest

    # Lose step 1's checkpoint (a crash after the prompt state was committed) and redo step 1:
    # no prefill shard is computed again — the shard tasks are Cached and the commit reads the
    # committed state back.
    checkpoint = runs_root / "runs" / "flow-resumed" / "checkpoints" / "v000002"
    assert checkpoint.is_dir()
    shutil.rmtree(checkpoint)
    third, flow_run_id = _train(config, resume=True)
    assert [m.step for m in third] == [1]
    assert (third[0].shards_computed, third[0].shards_reused) == (0, NUM_SHARDS)
    from prefect import get_client

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run_id).name == "flow-resumed resumed"
    assert state_names(task_runs_of(flow_run_id), "prefill_shard") == ["Cached"] * NUM_SHARDS
    cached = [m for m in (log.message for log in logs_of(flow_run_id)) if "cache key" in m]
    assert len(cached) == NUM_SHARDS and all(m.startswith("Cached: ") for m in cached), cached
    assert final_weights_digest(config) == in_process_digest

    # Three flow runs, one TensorBoard run: the redone step 1 was not logged again.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = runs_root / "runs" / "flow-resumed" / "trackers" / "tensorboard"
    assert len(list(logs.glob("events.out.tfevents.*"))) == 3
    events = EventAccumulator(str(logs), size_guidance={"scalars": 0})
    events.Reload()
    # TensorBoard keeps float32; the redone step 1 (third) was not logged again.
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [
        (m.step, float(np.float32(m.reward_mean))) for m in (*first, *second)
    ]
    assert [e.step for e in events.Tensors("completions/text_summary")] == [0, 1]
    # The UI's completions: one version per step over the three flow runs; the redone step 1
    # drew the same responses and was not published again.
    _assert_completions_tables(config, [*first, *second])


def _recorded(config) -> list:
    """The run's rows of metrics.jsonl."""
    from longstraw.storage.checkpoints import run_dir
    from longstraw.training.metrics import read_metrics

    return read_metrics(run_dir(config.storage, config.run_id))


def _tensorboard(config):
    """`config` logging to TensorBoard (the trackers' tests cover the others)."""
    from longstraw.schemas.tracking import TrackingConfig

    return config.model_copy(update={"tracking": TrackingConfig(report_to=["tensorboard"])})


def test_curves_cover_a_failed_run_and_its_resume_which_the_run_tag_links(
    prefect_harness, runs_root, monkeypatch
):
    import base64

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    from longstraw.flows.train import train

    config = tiny_run_config(runs_root, "flow-failed", num_steps=2)
    # Step 0 scores its G responses; step 1's first reward call fails.
    monkeypatch.setenv("LONGSTRAW_TEST_REWARD_FAIL_AFTER_CALLS", str(NUM_GENERATIONS))
    failed = train(config.model_dump(mode="json"), return_state=True)
    assert failed.is_failed(), failed
    curves = latest_artifacts(failed.state_details.flow_run_id)
    # The step that finished before the failure is in the UI's curves and plot.
    assert [row["step"] for row in json.loads(curves["flow-failed-curves"].data)] == [0]
    png = curves["flow-failed-reward-plot"].data
    assert png.startswith("data:image/png;base64,")
    assert base64.b64decode(png.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    # And its sampled completions: step 0's table, the latest version of the run's key.
    table = json.loads(curves["flow-failed-completions"].data)
    assert {row["step"] for row in table} == {0}

    monkeypatch.delenv("LONGSTRAW_TEST_REWARD_FAIL_AFTER_CALLS")
    resumed, resumed_id = _train(config, resume=True)
    assert [m.step for m in resumed] == [1]
    curves = latest_artifacts(resumed_id)
    rows = json.loads(curves["flow-failed-curves"].data)
    # The resumed flow run's curves are the whole run's: step 0 (before the failure) included.
    assert [row["step"] for row in rows] == [0, 1]
    assert rows[1]["reward_mean"] == float(f"{resumed[0].reward_mean:.4g}")
    assert [r["step"] for r in json.loads(curves["flow-failed-metrics"].data)] == [0, 1]
    # The completions: step 0's version (the failed flow run's), then step 1's (the resume's).
    _assert_completions_tables(config, _recorded(config))
    assert {row["step"] for row in json.loads(curves["flow-failed-completions"].data)} == {1}
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["run:flow-failed"])),
            sort=FlowRunSort.START_TIME_ASC,
        )
    trains = [r for r in runs if "/step-" not in r.name]
    assert [(r.name, r.state.type.value) for r in trains] == [
        ("flow-failed", "FAILED"),
        ("flow-failed resumed", "COMPLETED"),
    ]
    assert "resumed-at:step-1" in trains[1].tags
    steps = sorted((r.name, r.state.type.value) for r in runs if "/step-" in r.name)
    assert steps == [
        ("flow-failed/step-0000", "COMPLETED"),
        ("flow-failed/step-0001", "COMPLETED"),
        ("flow-failed/step-0001", "FAILED"),
    ]


def test_longstraw_train_on_a_server_prints_the_flow_runs_ui_page_once(
    prefect_harness, runs_root, tmp_path
):
    import os
    import subprocess
    import sys

    from flow_helpers import write_run_yaml
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.settings import PREFECT_API_URL

    api_url = PREFECT_API_URL.value()  # the harness's server: a real one, not the embedded API
    config = write_run_yaml(tmp_path / "run.yaml", runs_root, "ui-link", num_steps=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_API_URL=api_url,
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        # The tiny config's reward lives in tests/flows/flow_helpers.py.
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "flows")]),
    )
    result = subprocess.run(
        [sys.executable, "-m", "longstraw.cli", "train", "--config", str(config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["run:ui-link"]))
        )
    flow_run = next(r for r in runs if r.name == "ui-link")
    # Prefect's default UI URL is the API's without /api (PREFECT_UI_URL sets another).
    page = f"{api_url.removesuffix('/api')}/runs/flow-run/{flow_run.id}"
    links = [line for line in result.stdout.splitlines() if "/runs/flow-run/" in line]
    assert links == [f"Prefect UI: {page}"], result.stdout
