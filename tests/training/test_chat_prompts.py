"""Prompts given as chat messages (`messages` in a JSONL prompt file): rendered by the tokenizer's
chat template up to the assistant header, checked by the preflight at their line, and trained on
outside agent runs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from longstraw.errors import UserError
from longstraw.schemas.run import RunConfig
from longstraw.training.loop import train
from longstraw.training.preflight import check_prompts, preflight
from longstraw.training.prompts import ChatPrompts, run_prompt_source

CHAT = [
    {"role": "system", "content": "Answer with one digit."},
    {"role": "user", "content": "key 12 = 7; key 40 = 3. What is key 40?"},
]
# What the tiny checkpoints' ChatML template (longstraw.models.tokenizer.CHAT_TEMPLATE) renders.
CHAT_TEXT = (
    "<|im_start|>system\nAnswer with one digit.<|im_end|>\n"
    "<|im_start|>user\nkey 12 = 7; key 40 = 3. What is key 40?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _config(tmp_path: Path, checkpoint: Path, lines: list[str], **sections) -> RunConfig:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return RunConfig.model_validate(
        {
            "run_id": "chat",
            "model": {"checkpoint": str(checkpoint)},
            # One shard, one group of two, detached: the prompt is under test, not the gradient.
            "engine": {"shard_tokens": 64, "prompt_grad": "detached"},
            "grpo": {"num_generations": 2, "max_completion_length": 2, "loss_type": "grpo"},
            "data": {"type": "jsonl", "path": str(path), "rewards": ["haystack_exact"]},
            "train": {"num_steps": 1, "groups_per_step": 1},
            "storage": {"root_uri": str(tmp_path / "root"), "persist_mode": "off"},
            **sections,
        }
    )


def test_chat_messages_are_rendered_by_the_chat_template_and_trained(tmp_path, checkpoint_dir):
    checkpoint = checkpoint_dir("qwen3_5")
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    lines = [
        json.dumps({"id": "chat", "messages": CHAT, "metadata": {"values": ["3"]}}),
        json.dumps({"id": "text", "prompt": "key 40 = 3"}),
    ]
    config = _config(tmp_path, checkpoint, lines)
    preflight(config, resume=False)
    expected = tokenizer.encode(CHAT_TEXT, add_special_tokens=False)
    text_ids = tokenizer.encode("key 40 = 3", add_special_tokens=False)
    assert check_prompts(config) == [len(expected), len(text_ids)]

    source = run_prompt_source(config, tokenizer)
    chat, plain = source(0), source(1)
    assert chat.prompt_ids.tolist() == expected and chat.text == CHAT_TEXT
    assert chat.metadata == {"values": ["3"]}
    assert plain.prompt_ids.tolist() == text_ids and not plain.chat
    # An agent run frames a text prompt as a user message, and leaves a chat as it is.
    framed = ChatPrompts(source, tokenizer, system="S")
    assert framed(0).prompt_ids.tolist() == expected
    assert len(framed(1).prompt_ids) > len(text_ids)

    outcome = train(config)
    assert outcome.policy_version == 1
    assert outcome.history[0].prompt_tokens == len(expected)


def test_a_prompt_record_with_text_and_messages_is_refused_at_its_line(tmp_path, checkpoint_dir):
    lines = [
        json.dumps({"id": "a", "messages": CHAT}),
        json.dumps({"id": "b", "prompt": "x", "messages": CHAT}),
    ]
    config = _config(tmp_path, checkpoint_dir("qwen3_5"), lines)
    with pytest.raises(UserError) as error:
        preflight(config, resume=False)
    assert error.value.one_line().startswith(
        f"data.path {tmp_path / 'prompts.jsonl'}:2: field 'prompt': 'prompt' and 'messages' are "
        "given together: give exactly one of 'prompt' (text), 'prompt_ids' (token ids) or "
        "'messages' (chat messages) — fix that line"
    ), error.value.one_line()


def test_messages_without_a_chat_template_are_refused_at_their_line(tmp_path, checkpoint_dir):
    # The tiny checkpoint without its chat template (weights linked, not copied).
    source, model = checkpoint_dir("qwen3_5"), tmp_path / "no-template"
    model.mkdir()
    for file in source.iterdir():
        if file.suffix == ".safetensors":
            os.symlink(file, model / file.name)
        elif file.name != "chat_template.jinja":
            shutil.copy(file, model / file.name)
    assert not AutoTokenizer.from_pretrained(str(model)).chat_template
    lines = [json.dumps({"id": "a", "prompt": "x"}), json.dumps({"id": "b", "messages": CHAT})]
    with pytest.raises(UserError) as error:
        preflight(_config(tmp_path, model, lines), resume=False)
    message = error.value.one_line()
    assert message.startswith(
        f"data.path {tmp_path / 'prompts.jsonl'}:2: field 'messages': the chat template cannot "
        "render them (the tokenizer has no chat template) — use a checkpoint"
    ), message
    assert message.count(" — ") == 1, message
