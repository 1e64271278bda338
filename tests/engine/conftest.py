"""Engine-test fixtures: one fp32 model per family for the whole session, grads cleared per use."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


@pytest.fixture(scope="session")
def _model_cache() -> dict:
    return {}


@pytest.fixture
def tiny_model(load_tiny, _model_cache) -> Callable[..., torch.nn.Module]:
    """`tiny_model(family, dtype=torch.float32)` -> the session's model of that family, no .grad.

    Loading costs ~0.5 s per family; tests only read weights and write `.grad`, so sharing one
    model per family is safe once its gradients are cleared.
    """

    def get(family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        key = (family, dtype)
        if key not in _model_cache:
            _model_cache[key] = load_tiny(family, dtype)
        model = _model_cache[key]
        for p in model.parameters():
            p.grad = None
        return model

    return get
