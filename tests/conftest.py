"""Session-wide fixtures: real tiny HF checkpoints built once per test session.

Every test that needs a model loads it from a checkpoint directory written by `init_model`, so it
goes through the same `from_pretrained` path a user's checkpoint takes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Tests run on 2 cores; more threads only add contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ENGINE_FAMILIES = ("llama", "qwen3", "qwen3_5", "qwen3_next")
SEED = 42


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory) -> Callable[..., Path]:
    """`checkpoint_dir(family, size="tiny")` -> a checkpoint directory, built on first use."""
    from longstraw.models.factory import init_model

    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[tuple[str, str], Path] = {}

    def get(family: str, size: str = "tiny") -> Path:
        key = (family, size)
        if key not in built:
            built[key] = init_model(family, size, root / f"{family}-{size}", seed=SEED)
        return built[key]

    return get


@pytest.fixture(scope="session")
def load_tiny(checkpoint_dir) -> Callable[..., torch.nn.Module]:
    """`load_tiny(family, dtype=torch.float32)` -> a fresh model loaded from its checkpoint."""
    from longstraw.models.checkpoint import load_checkpoint

    def load(family: str, dtype: torch.dtype = torch.float32, size: str = "tiny"):
        model, _, _ = load_checkpoint(checkpoint_dir(family, size), dtype=dtype)
        model.eval()  # dropout-free either way; eval() documents that no train-mode path is used
        return model

    return load


@pytest.fixture(scope="session")
def load_tokenizer(checkpoint_dir) -> Callable[..., object]:
    """`load_tokenizer(family)` -> the checkpoint's tokenizer as AutoTokenizer loads it."""
    from transformers import AutoTokenizer

    def load(family: str, size: str = "tiny"):
        return AutoTokenizer.from_pretrained(str(checkpoint_dir(family, size)))

    return load
