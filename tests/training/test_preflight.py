"""`preflight(config, resume)`: each user error is found before any expensive work, as one
`<what> — <fix>` line; `longstraw train` prints it as `error: ...` and exits 2 (no traceback
unless --debug)."""

from __future__ import annotations

import json
import os
import shutil
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


@pytest.mark.processes
def test_a_reward_module_beside_the_config_file_imports_from_any_directory(
    tmp_path, checkpoint_dir
):
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "beside_rewards.py").write_text(
        textwrap.dedent(
            """
            def three_quarters(prompt, response, metadata):
                return 0.75
            """
        )
    )
    config = {
        "run_id": "beside",
        "model": {"checkpoint": str(checkpoint_dir("llama"))},
        "train": {"num_steps": 1, "groups_per_step": 1},
        "grpo": {"num_generations": 2, "max_completion_length": 2},
        "data": {"type": "haystack", "rewards": ["beside_rewards:three_quarters"]},
        "storage": {"root_uri": str(tmp_path / "root"), "persist_mode": "off"},
    }
    (configs / "run.yaml").write_text(yaml.safe_dump(config))
    # Only this checkout on PYTHONPATH; the working directory is not the config's.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "longstraw.cli", "train", "--config", "configs/run.yaml"]
    result = subprocess.run(
        [*command, "--no-prefect"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    row = next(line for line in result.stdout.splitlines() if line.startswith("│    0 │"))
    assert "0.750" in row, result.stdout  # the mean reward: the function beside the config ran


def test_a_deployment_config_file_makes_its_directory_importable(tmp_path, monkeypatch):
    from longstraw.data.environments import environment_class
    from longstraw.grpo.rewards import get_reward
    from longstraw.storage.config_files import read_run_config

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "deployed_task.py").write_text(
        textwrap.dedent(
            """
            def one(prompt, response, metadata):
                return 1.0
            class Echo:
                def reset(self, metadata):
                    pass
                def step(self, assistant_text):
                    return assistant_text, True, 1.0
            """
        )
    )
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump({"data": {"type": "haystack", "rewards": ["deployed_task:one"]}})
    )
    with pytest.raises(ValueError, match="cannot import module 'deployed_task'"):
        get_reward("deployed_task:one")
    config = read_run_config(f"file://{tmp_path / 'run.yaml'}")
    assert get_reward(config.data.rewards[0])("p", "r", {}) == 1.0
    assert environment_class("deployed_task:Echo")().step("hi") == ("hi", True, 1.0)
    monkeypatch.delitem(sys.modules, "deployed_task")


def test_storage_root_must_be_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _fails(_config(blocker / "root"), "storage.root_uri .* is not writable")


def test_more_ranks_than_prefill_shards_is_refused(tmp_path):
    # The default 64-token prompt in 23-token shards: 3 shards.
    preflight(_config(tmp_path, parallel={"world_size": 3}), False)
    _fails(_config(tmp_path, parallel={"world_size": 4}), "world_size 4 is more than the 3")
    # Replicas: each prompt is sharded over world_size / data_parallel ranks.
    preflight(_config(tmp_path, parallel={"world_size": 6, "data_parallel": 2}), False)
    _fails(
        _config(tmp_path, parallel={"world_size": 8, "data_parallel": 2}),
        "data_parallel 2 = 4 sequence ranks is more than the 3 .* raise parallel.data_parallel",
    )


def test_world_size_must_be_a_multiple_of_the_replicas(tmp_path):
    with pytest.raises(ValueError, match="world_size 3 is not a multiple of data_parallel 2"):
        _config(tmp_path, parallel={"world_size": 3, "data_parallel": 2})


def test_jsonl_data_path_must_exist(tmp_path):
    data = {"type": "jsonl", "path": str(tmp_path / "missing.jsonl"), "rewards": ["haystack_exact"]}
    _fails(_config(tmp_path, data=data), "data.path .*missing.jsonl does not exist")


@pytest.mark.processes
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


def _jsonl(tmp_path: Path, lines: list[str], name: str = "prompts.jsonl", **data) -> dict:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return {"data": {"type": "jsonl", "path": str(path), "rewards": ["haystack_exact"], **data}}


@pytest.mark.parametrize(
    ("lines", "pattern"),
    [
        (
            ['{"id": "a", "prompt_ids": [1, 2]}', '{"id": "b", "prompt_ids": [1,'],
            r":2: invalid JSON",
        ),
        (
            ['{"id": "a", "promt": "x"}'],
            r":1: field 'promt': unknown field \(did you mean 'prompt'\?\)",
        ),
        (['{"id": "a", "prompt": ""}'], r":1: field 'prompt': is empty"),
        (['{"id": "a", "prompt_ids": []}'], r":1: field 'prompt_ids': is empty"),
        (["", "   "], r"prompts.jsonl holds no prompts"),
        (
            ['{"id": "a", "prompt_ids": [1, 2]}', '{"id": "b", "prompt_ids": [3, 512, 4]}'],
            r":2: prompt 'b': prompt_ids\[1\] is 512, outside the vocabulary .*vocab_size 512",
        ),
    ],
    ids=["bad-json", "misspelt-field", "empty-prompt", "empty-ids", "no-prompts", "vocab"],
)
def test_jsonl_prompt_errors_name_the_file_and_the_line(tmp_path, checkpoint_dir, lines, pattern):
    model = {"model": {"checkpoint": str(checkpoint_dir("qwen3_5"))}}
    message = _fails(_config(tmp_path, **model, **_jsonl(tmp_path, lines)), pattern)
    assert message.startswith(f"data.path {tmp_path / 'prompts.jsonl'}"), message


def test_jsonl_text_prompts_are_tokenized_and_pass(tmp_path, checkpoint_dir):
    from longstraw.training.preflight import check_prompts

    lines = ['{"id": "a", "prompt": "key 12 has value 7"}', '{"id": "b", "prompt_ids": [5, 6, 7]}']
    config = _config(
        tmp_path, model={"checkpoint": str(checkpoint_dir("qwen3_5"))}, **_jsonl(tmp_path, lines)
    )
    preflight(config, False)
    lengths = check_prompts(config)
    assert lengths[1] == 3 and lengths[0] > 1, lengths


def test_a_prompt_longer_than_the_model_supports_is_refused(tmp_path, checkpoint_dir):
    # The tiny checkpoint with max_position_embeddings 40 (its weights linked, not copied).
    source = checkpoint_dir("llama")
    short = tmp_path / "short-model"
    short.mkdir()
    for file in source.iterdir():
        (short / file.name).symlink_to(file)
    (short / "config.json").unlink()
    raw = json.loads((source / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": 40}))
    model = {"model": {"checkpoint": str(short)}}
    # The default haystack task: 64-token prompts, 2 response tokens.
    _fails(
        _config(tmp_path, **model),
        r"data.task.num_prompt_tokens is 64 tokens; with grpo.max_completion_length 2 it needs "
        r"66 positions, but .*short-model supports 40 \(max_position_embeddings",
    )
    ids = list(range(1, 40))  # 39 tokens + 2 response tokens = 41 positions
    lines = [
        '{"id": "fits", "prompt_ids": [1, 2, 3]}',
        json.dumps({"id": "long", "prompt_ids": ids}),
    ]
    _fails(_config(tmp_path, **model, **_jsonl(tmp_path, lines)), r":2: prompt 'long' is 39 tokens")


def test_reward_weights_must_match_the_rewards(tmp_path, checkpoint_dir):
    rewards = {"type": "haystack", "rewards": ["haystack_exact", "haystack_partial"]}
    preflight(_config(tmp_path, data=rewards, grpo={"reward_weights": [1.0, 0.5]}), False)
    _fails(
        _config(tmp_path, data=rewards, grpo={"reward_weights": [1.0]}),
        r"grpo.reward_weights has 1 weight\(s\) for the 2 reward\(s\) of data.rewards "
        r"\(haystack_exact, haystack_partial\)",
    )
    # A record with its own reward is scored by that one reward alone: one weight, or none.
    lines = [
        '{"id": "a", "prompt_ids": [1, 2]}',
        '{"id": "b", "prompt_ids": [1, 2], "reward": "haystack_partial"}',
    ]
    data = _jsonl(tmp_path, lines, rewards=["haystack_exact", "haystack_partial"])
    config = _config(
        tmp_path,
        model={"checkpoint": str(checkpoint_dir("qwen3_5"))},
        grpo={"reward_weights": [1.0, 0.5]},
        **data,
    )
    _fails(
        config, r":2: prompt 'b' names its own reward 'haystack_partial', but grpo.reward_weights"
    )


def test_nccl_without_a_gpu_per_rank_is_refused(tmp_path):
    import torch

    parallel = {"backend": "nccl", "world_size": 2}
    _fails(
        _config(tmp_path, parallel=parallel, model={"device": "cpu"}),
        "parallel.backend nccl needs GPUs, but model.device is cpu — set parallel.backend: gloo",
    )
    if not torch.cuda.is_available():
        _fails(_config(tmp_path, parallel=parallel), "CUDA is not available on this machine")
    elif torch.cuda.device_count() < 2:
        _fails(_config(tmp_path, parallel=parallel), "runs 2 ranks on this machine but it has 1")
    # One process opens no process group: the backend is not used.
    preflight(_config(tmp_path, parallel={"backend": "nccl"}, model={"device": "cpu"}), False)


def _small_tmpfs(path: Path, size: str) -> bool:
    """Mount a tmpfs of `size` at `path` where this process may (root in a VM or container
    with CAP_SYS_ADMIN); False elsewhere."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return done.returncode == 0


@pytest.mark.processes
def test_a_root_without_room_for_one_step_is_refused_naming_the_sizes(tmp_path):
    from longstraw.training.preflight import check_prompts, step_write_bytes

    disk = tmp_path / "small-disk"
    if not _small_tmpfs(disk, "512k"):
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        config = _config(
            disk / "root", storage={"root_uri": str(disk / "root"), "persist_mode": "synchronous"}
        )
        writes = step_write_bytes(config, check_prompts(config))
        # The demo's step: two 64-token prompt states and a checkpoint of the tiny model (MiB).
        assert writes["checkpoint"] > 512 * 2**10 and writes["prompt states"] > 0, writes
        message = _fails(
            config,
            r"has .* free, but one step writes about .* MiB \(prompt states .*, checkpoint .* MiB",
        )
        assert "free at least" in message and str(disk / "root") in message, message
        assert not list((disk / "root").iterdir())  # the probe left nothing behind
    finally:
        subprocess.run(["umount", str(disk)], check=True)
