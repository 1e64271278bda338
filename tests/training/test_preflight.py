"""`preflight(config, resume)`: each user error is found before any expensive work, as one
`<what> — <fix>` line; `longstraw train` prints it as `error: ...` and exits 2 (no traceback
unless --debug)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from longstraw.errors import UserError
from longstraw.grpo.rewards import RewardError, score_group
from longstraw.schemas.run import RunConfig
from longstraw.training.preflight import preflight

REPO = Path(__file__).resolve().parents[2]


def _config(root: Path, **sections) -> RunConfig:
    return RunConfig.model_validate(
        {"run_id": "pre", "storage": {"root_uri": str(root)}, **sections}
    )


def _fails(config: RunConfig, pattern: str, resume: bool = False) -> str:
    with pytest.raises(UserError, match=pattern) as error:
        preflight(config, resume)
    message = error.value.one_line()
    assert " — " in message, message  # what, then the fix
    return message


def test_the_default_config_passes(tmp_path):
    preflight(_config(tmp_path), resume=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".longstraw-probe")]


def test_model_checkpoint_must_be_a_supported_hf_directory(tmp_path, checkpoint_dir):
    preflight(_config(tmp_path, model={"checkpoint": str(checkpoint_dir("qwen3_5"))}), False)
    _fails(_config(tmp_path, model={"checkpoint": str(tmp_path / "nope")}), "does not exist")
    (tmp_path / "empty").mkdir()
    _fails(_config(tmp_path, model={"checkpoint": str(tmp_path / "empty")}), "config.json")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (gpt2 / "model.safetensors").write_bytes(b"")
    _fails(_config(tmp_path, model={"checkpoint": str(gpt2)}), "'gpt2' model.*qwen3_5")


def test_resume_needs_a_run_that_started(tmp_path):
    _fails(_config(tmp_path), "--resume: run 'pre' has never started", resume=True)
    (tmp_path / "runs" / "pre").mkdir(parents=True)
    (tmp_path / "runs" / "pre" / "RUN.lock").write_text("{}")  # a lease alone is no start
    _fails(_config(tmp_path), "--resume: run 'pre' has never started", resume=True)
    (tmp_path / "runs" / "pre" / "policy-v0").mkdir()  # crashed before its first checkpoint
    preflight(_config(tmp_path), resume=True)


def test_reward_specs_import_and_take_prompt_response_metadata(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def good(prompt, response, metadata):
                return 1.0
            def two_args(prompt, response):
                return 1.0
            def boom(prompt, response, metadata):
                raise KeyError("answer")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def data(*rewards):
        return {"data": {"type": "haystack", "rewards": list(rewards)}}

    preflight(_config(tmp_path, **data("haystack_shaped", "my_rewards:good")), False)
    _fails(_config(tmp_path, **data("no_such_module_x:fn")), "cannot import module")
    _fails(_config(tmp_path, **data("my_rewards:missing")), "has no attribute")
    _fails(_config(tmp_path, **data("my_rewards:two_args")), r"my_rewards:two_args.*\(prompt, re")
    # A reward that raises while training names itself and the sample.
    with pytest.raises(RewardError, match=r"'my_rewards:boom' raised KeyError.*on sample 0"):
        score_group(["my_rewards:boom"], None, "p", ["r0", "r1"])


def test_storage_root_must_be_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _fails(_config(blocker / "root"), "storage.root_uri .* is not writable")


def test_more_ranks_than_prefill_shards_is_refused(tmp_path):
    # The default 64-token prompt in 23-token shards: 3 shards.
    preflight(_config(tmp_path, parallel={"world_size": 3}), False)
    _fails(_config(tmp_path, parallel={"world_size": 4}), "world_size 4 is more than the 3")


def test_jsonl_data_path_must_exist(tmp_path):
    data = {"type": "jsonl", "path": str(tmp_path / "missing.jsonl"), "rewards": ["haystack_exact"]}
    _fails(_config(tmp_path, data=data), "data.path .*missing.jsonl does not exist")


def test_cli_prints_one_line_and_exits_2_and_debug_shows_the_traceback(tmp_path):
    config = _config(tmp_path / "root", model={"checkpoint": str(tmp_path / "no-model")})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "longstraw.cli", "train", "--config", "run.yaml"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: model.checkpoint ") and "does not exist — " in lines[0]
    assert "starting Prefect" not in result.stdout  # refused before Prefect or any prefill
    debug = subprocess.run(
        [*command, "--debug"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_segments_on_ranks_are_refused_only_for_glm(tmp_path, checkpoint_dir):
    from longstraw.training.preflight import check_sharded_branches

    def config(family: str, **engine) -> RunConfig:
        return _config(
            tmp_path,
            model={"checkpoint": str(checkpoint_dir(family))},
            engine=engine,
            parallel={"world_size": 2},
        )

    check_sharded_branches(config("qwen3_5", branch_segment_tokens=8))
    check_sharded_branches(config("qwen3_5", share_response_prefixes=True))
    check_sharded_branches(config("glm_moe_dsa"))
    for engine in ({"branch_segment_tokens": 8}, {"share_response_prefixes": True}):
        with pytest.raises(UserError, match="GLM-5 .*parallel.world_size: 1"):
            check_sharded_branches(config("glm_moe_dsa", **engine))
