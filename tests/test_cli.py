"""`longstraw` CLI through typer's CliRunner: init-model writes a checkpoint transformers loads,
and bad choices are rejected with a message that lists the valid ones."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from longstraw.cli import app
from longstraw.models.checkpoint import read_checkpoint_metadata, weights_digest_of


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def plain(text: str) -> str:
    """CLI output without rich's colour codes and box drawing, whitespace collapsed."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    text = re.sub(r"[│╭╮╰╯─]", " ", text)
    return " ".join(text.split())


def test_init_model_writes_a_loadable_checkpoint(runner, tmp_path):
    out = tmp_path / "ckpt"
    result = runner.invoke(
        app, ["init-model", "--family", "qwen3_5", "--size", "tiny", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and "qwen3_5_text" in result.output, result.output
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer("key 12 is A", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    assert read_checkpoint_metadata(out).weights_digest == weights_digest_of(out)


def test_init_model_seed_and_dtype_options(runner, tmp_path):
    args = ["init-model", "--family", "llama", "--seed", "7", "--dtype", "bfloat16"]
    assert runner.invoke(app, [*args, "--out", str(tmp_path / "a")]).exit_code == 0
    assert runner.invoke(app, [*args, "--out", str(tmp_path / "b")]).exit_code == 0
    digest = read_checkpoint_metadata(tmp_path / "a").weights_digest
    assert digest == read_checkpoint_metadata(tmp_path / "b").weights_digest
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "a")).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("option", "value", "choices"),
    [
        ("--family", "gpt2", "choose one of llama, qwen3, qwen3_5, qwen3_next, glm_moe_dsa"),
        ("--size", "huge", "choose one of tiny, small"),
        ("--dtype", "float16", "choose float32 or bfloat16"),
    ],
)
def test_init_model_rejects_unknown_choices_with_a_message(
    runner, tmp_path, option, value, choices
):
    args = {"--family": "llama", "--size": "tiny", "--dtype": "float32"}
    args[option] = value
    flat = [part for pair in args.items() for part in pair]
    out = tmp_path / "never"
    result = runner.invoke(app, ["init-model", *flat, "--out", str(out)])
    assert result.exit_code == 2, result.output
    message = plain(result.output)
    assert option in message and choices in message, message
    assert not out.exists()


def test_init_model_requires_family_and_out(runner):
    result = runner.invoke(app, ["init-model"])
    assert result.exit_code == 2
    assert "--family" in plain(result.output)


def test_help_lists_the_commands(runner):
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("init-model", "merge", "train", "state", "bench"):
        assert command in result.output, result.output


def test_merge_of_a_directory_without_adapters_is_one_error_line(runner, tmp_path):
    result = runner.invoke(app, ["merge", str(tmp_path), "--out", str(tmp_path / "merged")])
    assert result.exit_code == 2
    assert "holds no adapter_config.json" in plain(result.output), result.output
    assert not (tmp_path / "merged").exists()


def test_a_resume_with_no_step_left_says_so_instead_of_an_empty_table():
    from rich.table import Table

    from longstraw.schemas.results import StepMetrics
    from longstraw.schemas.run import RunConfig
    from longstraw.train_entry import run_summary

    config = RunConfig(run_id="r1", train={"num_steps": 3})
    line = run_summary(config, [])
    assert line == (
        "run 'r1' already has all 3 steps: nothing to run; pass --steps N (more than 3) with "
        "--resume to train further"
    )
    step = StepMetrics(
        step=2,
        policy_version=2,
        reward_mean=0.5,
        reward_std=0.1,
        advantage_mean=0.0,
        advantage_std=1.0,
        advantage_min=-1.0,
        advantage_max=1.0,
        loss=0.1,
    )
    table = run_summary(config, [step])
    assert isinstance(table, Table) and table.row_count == 1


def test_train_help_offers_no_prefect_without_a_double_negation(runner, tmp_path):
    result = runner.invoke(app, ["train", "--help"])
    assert result.exit_code == 0, result.output
    help_text = plain(result.output)
    assert "--no-prefect" in help_text, help_text
    assert "--no-no-prefect" not in help_text, help_text
    # The documented spelling still parses: the run gets as far as reading its config.
    missing = tmp_path / "missing.yaml"
    result = runner.invoke(app, ["train", "--no-prefect", "--config", str(missing)])
    assert result.exit_code == 2 and "does not exist" in plain(result.output), result.output
    refused = runner.invoke(app, ["train", "--no-no-prefect"])
    assert refused.exit_code == 2 and "No such option" in plain(refused.output), refused.output
