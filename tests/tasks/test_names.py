"""Task run names and tags the UI shows, built from a task's parameters (no Prefect run needed)."""

from __future__ import annotations

from types import SimpleNamespace

from longstraw.audit.names import (
    STAGE_TAGS,
    TASK_RUN_NAMES,
    round_significant,
    rounded_rows,
    step_flow_run_name,
    step_tags,
    task_tags,
)
from longstraw.tasks import stages

PROMPT = SimpleNamespace(index=1, num_shards=32, prompt_digest="3f9a2b7c41d0e5a6b8c9", step=7)
POLICY = SimpleNamespace(step=7, policy_version=8)


def _name(task_name: str, **parameters) -> str:
    return TASK_RUN_NAMES[task_name](parameters=parameters)


def test_every_stage_task_has_a_run_name_and_a_stage_tag():
    tasks = {t.name: t for t in vars(stages).values() if hasattr(t, "task_run_name")}
    assert set(tasks) == set(TASK_RUN_NAMES) == set(STAGE_TAGS)
    for name, t in tasks.items():
        assert t.task_run_name is TASK_RUN_NAMES[name]
        assert t.tags == task_tags(name)


def test_names_say_shard_group_and_version():
    rollout = SimpleNamespace(prompt=PROMPT)
    assert _name("prefill_shard", prompt=PROMPT, shard=3) == "prefill s3/32 group 1 3f9a2b7c41d0"
    assert _name("prefill_prompt", prompt=PROMPT) == "prefill group 1 (32 shards) 3f9a2b7c41d0"
    assert _name("rollout_group", prompt=PROMPT) == "rollout group 1"
    assert _name("score_group", rollout=rollout, which="reference") == "score reference group 1"
    # The prompt's run-wide index, as prefill and rollout say it, not the position in the step.
    assert _name("backward_group", rollout=rollout, group=0) == "backward group 1"
    assert (
        _name("backward_group", rollout=rollout, group=0, iteration=2)
        == "backward group 1 iteration 2"
    )
    assert _name("apply_update", policy=POLICY) == "update v8 to v9"
    assert _name("write_checkpoint", policy=POLICY) == "checkpoint v8"
    assert step_tags("r1", 7, 8) == ("run:r1", "step:7", "policy:v8")
    assert step_flow_run_name("r1", 7) == "r1/step-0007"
    assert task_tags("backward_group") == {"stage:backward", "gpu"}
    assert task_tags("write_checkpoint") == {"stage:checkpoint"}


def test_rounded_rows_keep_four_significant_digits_and_leave_other_values():
    assert round_significant(0.123456789) == 0.1235
    assert round_significant(-12345.678) == -12350.0
    assert round_significant(4.2e-7) == 4.2e-7
    rows = rounded_rows([{"step": 3, "loss": -0.000123456, "id": "r1", "ok": True}])
    assert rows == [{"step": 3, "loss": -0.0001235, "id": "r1", "ok": True}]
