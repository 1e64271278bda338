"""LoRA runs (`model.lora`): a run trains the adapters alone, checkpoints them in peft's format
(which peft loads on the base and `longstraw merge` folds into it), resumes bitwise, scores the KL
reference on its base with the adapters disabled, and says it is a LoRA run.

One 3-step run ("whole") and the same run stopped after 2 steps and resumed ("split"): qwen3_5
tiny, exact mode, 64-token prompts in 3 shards, beta 0.1 (a KL reference on every step), adapters
of rank 4 on every linear layer.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from longstraw.engine.prefill import prefill
from longstraw.engine.rollout import score_responses
from longstraw.errors import UserError
from longstraw.models.checkpoint import load_checkpoint, read_checkpoint_metadata
from longstraw.models.lora import merge_lora_checkpoint
from longstraw.schemas.run import RunConfig
from longstraw.storage import artifacts
from longstraw.storage.checkpoints import latest_checkpoint, load_optimizer_rows
from longstraw.training.loop import train
from longstraw.training.metrics import policy_description
from longstraw.training.preflight import preflight
from tests.training.helpers import algorithm_fields, run_config

LORA = {"r": 4, "lora_alpha": 8}
# fp32: a merged weight W + s B A rounds once where the adapted forward adds s B (A x) to W x.
MERGED_RTOL, MERGED_ATOL = 1e-5, 1e-5


def lora_config(root, checkpoint, **overrides) -> RunConfig:
    base = run_config(root, checkpoint, grpo={"beta": 0.1}, **overrides)
    raw = base.model_dump(mode="json")
    raw["model"]["lora"] = LORA
    return RunConfig.model_validate(raw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, checkpoint_dir):
    """(uninterrupted 3-step LoRA run, the same run resumed after 2 steps)."""
    root = tmp_path_factory.mktemp("lora")
    ckpt = checkpoint_dir("qwen3_5")
    whole = train(lora_config(root, ckpt, run_id="whole", num_steps=3))
    train(lora_config(root, ckpt, run_id="split", num_steps=2))
    resumed = train(lora_config(root, ckpt, run_id="split", num_steps=3), resume=True)
    return whole, resumed


def _adapter_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def test_only_the_adapters_train_and_hold_optimizer_state(runs, checkpoint_dir):
    whole, _ = runs
    ctx = whole.context()
    trainable = _adapter_names(ctx.model)
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sorted(ctx.optimizer.names) == sorted(trainable)
    # The frozen base is bitwise the checkpoint the run started from.
    base, _, _ = load_checkpoint(checkpoint_dir("qwen3_5"))
    base_params = dict(base.named_parameters())
    for name, p in ctx.model.get_base_model().named_parameters():
        if not p.requires_grad:
            clean = name.replace(".base_layer.", ".")
            assert torch.equal(p, base_params[clean]), name
    optimizer = load_optimizer_rows(latest_checkpoint(whole.config.storage, "whole"))
    keys = {k.split("/", 1)[1] for k in optimizer if not k.startswith("meta/")}
    assert keys == set(trainable), "optimizer state of the adapters and nothing else"
    assert any(m.grad_norm > 0 for m in whole.history)
    assert {m.trainable_parameters for m in whole.history} == {
        sum(p.numel() for p in ctx.model.parameters() if p.requires_grad)
    }


def test_resumed_lora_run_is_bitwise_the_uninterrupted_one(runs):
    whole, resumed = runs
    assert resumed.step == whole.step == 3
    assert [algorithm_fields(m) for m in resumed.history] == [
        algorithm_fields(m) for m in whole.history[-1:]
    ]
    assert resumed.checkpoint_digest == whole.checkpoint_digest
    a = load_file(
        str(latest_checkpoint(whole.config.storage, "whole") / "adapter_model.safetensors")
    )
    b = load_file(
        str(latest_checkpoint(resumed.config.storage, "split") / "adapter_model.safetensors")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_is_peft_format_and_loads_on_the_base(runs, checkpoint_dir):
    whole, _ = runs
    path = latest_checkpoint(whole.config.storage, "whole")
    names = {p.name for p in path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors"} <= names
    assert "model.safetensors" not in names and "config.json" not in names
    meta = read_checkpoint_metadata(path)
    base_meta = read_checkpoint_metadata(checkpoint_dir("qwen3_5"))
    assert meta.base_weights_digest == base_meta.weights_digest
    assert meta.policy_version == 3
    config = json.loads((path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")

    base = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir("qwen3_5")))
    loaded = PeftModel.from_pretrained(base, str(path))
    ctx = whole.context()
    ids = torch.arange(5, 45).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ctx.model(input_ids=ids).logits)


def test_merged_checkpoint_loads_in_transformers_with_the_adapted_log_probs(
    runs, checkpoint_dir, tmp_path
):
    whole, _ = runs
    path = latest_checkpoint(whole.config.storage, "whole")
    out = merge_lora_checkpoint(path, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    assert read_checkpoint_metadata(out).policy_version == 3
    ctx = whole.context()
    ids = torch.arange(5, 70).unsqueeze(0)
    with torch.no_grad():
        expected = torch.log_softmax(ctx.model(input_ids=ids).logits, -1)
        actual = torch.log_softmax(merged(input_ids=ids).logits, -1)
        base = torch.log_softmax(
            AutoModelForCausalLM.from_pretrained(str(checkpoint_dir("qwen3_5")))(
                input_ids=ids
            ).logits,
            -1,
        )
    torch.testing.assert_close(actual, expected, rtol=MERGED_RTOL, atol=MERGED_ATOL)
    assert not torch.allclose(base, expected, atol=1e-4), "the adapters changed nothing"


def test_kl_reference_is_the_base_scored_with_the_adapters_disabled(runs, checkpoint_dir):
    """Step 2's reference log-probs (adapters trained twice by then) equal those of the base
    loaded on its own, bitwise; the policy's own scores at that step differ."""
    whole, _ = runs
    config = whole.config
    base, _, _ = load_checkpoint(checkpoint_dir("qwen3_5"))
    ctx = whole.context()
    folder = artifacts.step_dir(config.storage, "whole", 2)
    files = sorted(folder.glob("scores-g*-reference.json"))
    assert len(files) == config.train.groups_per_step
    for file in files:
        index = int(file.name.split("-g")[1].split("-")[0])
        record = json.loads((folder / f"rollout-g{index}.json").read_text())
        responses = record["response_ids"]
        prompt = ctx.source(index).prompt_ids
        state = prefill(base, prompt, shard_tokens=config.engine.shard_tokens)
        expected = score_responses(base, state, responses)
        scored = json.loads(file.read_text())
        for got, want in zip(scored, expected, strict=True):
            assert torch.equal(torch.tensor(got), want)
        policy_scores = [r for r in record["sampler_logprobs"]]
        assert any(
            not torch.allclose(torch.tensor(p), w, atol=1e-4)
            for p, w in zip(policy_scores, expected, strict=True)
        ), "the reference equals the trained policy: the test checks nothing"
    # Step 2 started from weights the updates of steps 0-1 moved: its KL to the base is not 0.
    assert whole.history[2].kl > 0, [m.kl for m in whole.history]


def test_run_summary_says_it_is_a_lora_run(runs):
    whole, _ = runs
    line = policy_description(whole.config, whole.history)
    count = whole.history[-1].trainable_parameters
    assert line == f"LoRA r=4, lora_alpha=8 on all-linear, {count:,} trainable parameters"


# --- bad input: one line naming the field and its fix, before anything runs -------------------


def _preflight_error(config) -> str:
    with pytest.raises(UserError) as caught:
        preflight(config, resume=False)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_preflight_names_a_target_module_the_model_lacks(tmp_path, checkpoint_dir):
    config = lora_config(tmp_path, checkpoint_dir("qwen3_5"))
    raw = config.model_dump(mode="json")
    raw["model"]["lora"]["target_modules"] = ["q_proj", "no_such_proj"]
    message = _preflight_error(RunConfig.model_validate(raw))
    assert "model.lora.target_modules" in message and "no_such_proj" in message


def test_preflight_refuses_an_adapter_the_hand_written_path_would_skip(tmp_path, checkpoint_dir):
    """transformers' Gated DeltaNet reads its conv1d's weight without calling the module."""
    config = lora_config(tmp_path, checkpoint_dir("qwen3_5"))
    raw = config.model_dump(mode="json")
    raw["model"]["lora"]["target_modules"] = ["q_proj", "conv1d"]
    message = _preflight_error(RunConfig.model_validate(raw))
    assert "conv1d" in message and "model.lora.target_modules" in message


def test_preflight_refuses_dropout_on_glm_kv_b_proj(tmp_path, checkpoint_dir):
    config = lora_config(tmp_path, checkpoint_dir("glm_moe_dsa"))
    raw = config.model_dump(mode="json")
    raw["model"]["lora"] |= {"lora_dropout": 0.1, "target_modules": ["q_b_proj", "kv_b_proj"]}
    raw["engine"]["prompt_grad"] = "detached"
    raw["grpo"]["beta"] = 0.0
    message = _preflight_error(RunConfig.model_validate(raw))
    assert "kv_b_proj" in message and "lora_dropout" in message


def test_preflight_names_a_lora_checkpoint_given_as_the_model(runs, tmp_path):
    whole, _ = runs
    adapter = latest_checkpoint(whole.config.storage, "whole")
    config = lora_config(tmp_path, adapter)
    message = _preflight_error(config)
    assert "LoRA adapter" in message and "model.checkpoint" in message
    assert "longstraw merge" in message


def test_rank_below_one_is_refused_with_the_field_and_its_fix(tmp_path, checkpoint_dir):
    raw = lora_config(tmp_path, checkpoint_dir("qwen3_5")).model_dump(mode="json")
    raw["model"]["lora"]["r"] = 0
    with pytest.raises(ValueError, match=r"model\.lora\.r is 0.*set model\.lora\.r"):
        RunConfig.model_validate(raw)
