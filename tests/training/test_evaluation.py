"""`train.eval_steps` + `eval`: held-out prompts answered by the policy each N steps, their
rewards in the step's `metrics.jsonl` row and in the trackers as `eval/...`; deterministic, no
gradient work, and a resumed run evaluates only the steps it runs.

Legend: the tiny qwen3_5 hybrid; training on 40-token haystack prompts in one shard, detached
(the evaluation is under test, not the gradient); held-out haystack prompts of another seed.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from longstraw.errors import UserError
from longstraw.schemas.run import ConfigError, RunConfig, validated_run_config
from longstraw.trackers.metric_names import EVAL_NAMES
from longstraw.training import held
from longstraw.training.evaluation import evaluate
from longstraw.training.loop import train
from longstraw.training.metrics import read_metrics
from longstraw.training.preflight import preflight
from longstraw.training.step import IN_PROCESS
from tests.training.helpers import run_config, small_haystack_task

# A reward that differs between responses: equal numbers then mean equal completions.
REWARD = "tests.training.helpers:checksum_reward"
HELD_OUT = {
    "type": "haystack",
    "rewards": [REWARD],
    "num_prompts": 3,
    # seed 1000: not the training prompts (seeds 42...)
    "task": small_haystack_task(num_prompt_tokens=45, seed=1000),
}


def _config(root, checkpoint, num_steps: int, **eval_options) -> RunConfig:
    config = run_config(
        root,
        checkpoint,
        run_id="ev",
        num_steps=num_steps,
        grpo={"num_generations": 2},
        data={"rewards": [REWARD]},
        task={"num_prompt_tokens": 40},
        train={"groups_per_step": 1},
        engine={"prompt_grad": "detached", "shard_tokens": 39},
    )
    raw = config.model_dump(mode="json")
    raw["train"]["eval_steps"] = 1
    raw["eval"] = {"data": HELD_OUT, **eval_options}
    raw["tracking"] = {"report_to": ["tensorboard"]}
    return RunConfig.model_validate(raw)


def test_eval_steps_log_held_out_rewards_once_per_step_across_a_resume(tmp_path, checkpoint_dir):
    calls: list[int] = []

    def counted(config, policy):
        calls.append(policy.step)
        return evaluate(config, policy)

    stages = dataclasses.replace(IN_PROCESS, evaluate=counted)
    root, checkpoint = tmp_path / "root", checkpoint_dir("qwen3_5")
    first = train(_config(root, checkpoint, 1), stages=stages)
    assert calls == [1]  # after the step, on the weights it made
    before = read_metrics(first.run_path)
    config = _config(root, checkpoint, 2)
    resumed = train(config, resume=True, stages=stages)
    assert calls == [1, 2], "a resumed run evaluated a recorded step again"

    rows = read_metrics(resumed.run_path)
    assert len(rows) == 2 and rows[0].eval == before[0].eval
    for row in rows:
        assert row.eval.policy_version == row.policy_version + 1
        assert row.eval.num_prompts == 3 and row.eval.num_completions == 3  # greedy: one each
        flat = [x for group in row.eval.rewards for x in group]
        assert (row.eval.reward_min, row.eval.reward_max) == (min(flat), max(flat))
        assert row.eval.reward_mean == pytest.approx(sum(flat) / 3, abs=1e-12)
        assert row.seconds["eval"] > 0

    # Deterministic and gradient-free: the final weights evaluated again give the same numbers,
    # and leave the weights and their gradients as they were.
    ctx = held.policy(config, resumed.policy)
    weights = {n: p.detach().clone() for n, p in ctx.model.named_parameters()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in ctx.model.named_parameters()}
    assert evaluate(config, resumed.policy) == rows[-1].eval
    for name, param in ctx.model.named_parameters():
        assert torch.equal(param.detach(), weights[name]), name
        assert (param.grad is None and grads[name] is None) or torch.equal(param.grad, grads[name])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(
        str(resumed.run_path / "trackers" / "tensorboard"), size_guidance={"scalars": 0}
    )
    events.Reload()
    logged = events.Scalars("eval/reward")
    assert [e.step for e in logged] == [0, 1]
    assert [e.value for e in logged] == pytest.approx([r.eval.reward_mean for r in rows])
    assert set(EVAL_NAMES) <= set(events.Tags()["scalars"])


def test_sampled_evaluation_draws_several_completions_per_prompt(tmp_path, checkpoint_dir):
    config = _config(
        tmp_path / "root",
        checkpoint_dir("qwen3_5"),
        1,
        do_sample=True,
        num_generations=2,
        temperature=0.7,
    )
    row = train(config).history[0]
    assert row.eval.num_completions == 6 and [len(g) for g in row.eval.rewards] == [2, 2, 2]


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"train": {"eval_steps": 2}}, "train.eval_steps is set but there is no eval section"),
        ({"eval": {"data": HELD_OUT}}, "the eval section is set but train.eval_steps is not"),
        (
            {"train": {"eval_steps": 2}, "eval": {"data": HELD_OUT, "num_generations": 4}},
            "eval.num_generations is 4 with greedy decoding",
        ),
        (
            {
                "train": {"eval_steps": 2},
                "eval": {"data": HELD_OUT},
                "agent": {"environment": "key_lookup"},
            },
            "eval is not supported in agent runs",
        ),
    ],
)
def test_eval_settings_that_cannot_work_are_refused_saying_what_to_change(sections, message):
    with pytest.raises(ConfigError, match=message):
        validated_run_config(sections, "run.yaml")


@pytest.mark.slow
def test_evaluation_on_two_ranks_gives_the_single_process_numbers(tmp_path, checkpoint_dir):
    # Shards of 20: the 40-token training prompts in 2 shards, the held-out ones in 3, so each
    # rank holds part of every state and the ranks decode together.
    # Sampled: the ranks must also draw the same tokens from the same generator.
    single = _config(
        tmp_path / "world1", checkpoint_dir("qwen3_5"), 1, do_sample=True, num_generations=3
    )
    raw = single.model_dump(mode="json")
    raw["engine"]["shard_tokens"] = 20
    raw["tracking"] = {"report_to": []}
    reference = train(RunConfig.model_validate(raw)).history[0].eval
    raw["storage"]["root_uri"] = str(tmp_path / "world2")
    raw["parallel"] = {"world_size": 2, "backend": "gloo", "timeout_s": 120}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, "-m", "longstraw.cli", "train", "--config", "run.yaml", "--no-prefect"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = read_metrics(tmp_path / "world2" / "runs" / "ev")
    assert len({x for g in reference.rewards for x in g}) > 1, "rewards all equal: vacuous"
    assert row.eval == reference


def test_the_preflight_checks_the_held_out_prompts_naming_eval_data(tmp_path, checkpoint_dir):
    def held_out(**data) -> RunConfig:
        raw = _config(tmp_path / "root", checkpoint_dir("qwen3_5"), 1).model_dump(mode="json")
        raw["eval"]["data"] = {"type": "jsonl", "rewards": [REWARD], **data}
        return RunConfig.model_validate(raw)

    with pytest.raises(UserError, match=r"^eval.data.path .*nope.jsonl does not exist — "):
        preflight(held_out(path=str(tmp_path / "nope.jsonl")), resume=False)
    bad = tmp_path / "held-out.jsonl"
    bad.write_text('{"id": "a", "prompt": "key 12"}\n{"id": "b", "promt": "x"}\n')
    with pytest.raises(UserError) as error:
        preflight(held_out(path=str(bad)), resume=False)
    assert error.value.one_line().startswith(
        f"eval.data.path {bad}:2: field 'promt': unknown field (did you mean 'prompt'?)"
    ), error.value.one_line()
    with pytest.raises(UserError, match=r"^eval.data.rewards: .*no_such_module"):
        preflight(held_out(path=str(bad), rewards=["no_such_module:fn"]), resume=False)


def test_longstraw_eval_of_a_run_checkpoint_gives_the_numbers_the_run_recorded(
    tmp_path, checkpoint_dir
):
    """`longstraw eval --checkpoint` on the checkpoint a step wrote answers the held-out prompts
    as the run did after that step, sampled with the same draws; without it, the run's starting
    model, at policy version 0."""
    from typer.testing import CliRunner

    from longstraw.cli import app
    from longstraw.schemas.results import EvalMetrics

    # Sampled: the checkpoint's evaluation must also draw what the run drew after its step.
    config = _config(
        tmp_path / "root", checkpoint_dir("qwen3_5"), 1, do_sample=True, num_generations=2
    )
    outcome = train(config)
    (row,) = read_metrics(outcome.run_path)
    assert len({x for g in row.eval.rewards for x in g}) > 1, "rewards all equal: vacuous"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    runner = CliRunner()
    trained = outcome.run_path / "checkpoints" / "v000001"
    args = ["eval", "--config", str(path), "--checkpoint", str(trained)]
    done = runner.invoke(app, [*args, "--out", str(tmp_path / "v1.json")])
    assert done.exit_code == 0, done.output
    assert "3 prompts" in done.output, done.output
    assert EvalMetrics.model_validate_json((tmp_path / "v1.json").read_text()) == row.eval

    done = runner.invoke(app, ["eval", "--config", str(path), "--out", str(tmp_path / "v0.json")])
    assert done.exit_code == 0, done.output
    start = EvalMetrics.model_validate_json((tmp_path / "v0.json").read_text())
    assert start.policy_version == 0 and start.num_completions == 6


def test_longstraw_eval_without_an_eval_section_says_what_to_add(tmp_path, checkpoint_dir):
    from typer.testing import CliRunner

    from longstraw.cli import app

    raw = _config(tmp_path / "root", checkpoint_dir("qwen3_5"), 1).model_dump(mode="json")
    raw["train"]["eval_steps"], raw["eval"] = None, None
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    done = CliRunner().invoke(app, ["eval", "--config", str(path)])
    assert done.exit_code == 2
    assert f"error: {path} has no eval section — add eval:" in done.output, done.output
