"""Checks of user input to the engine, each failing with a message that says what to change."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from longstraw.models.adapters import StateSpec


def as_token_tensor(
    ids: torch.Tensor | Sequence[int], *, what: str, vocab_size: int
) -> torch.Tensor:
    """1-D int64 CPU/any-device tensor of token ids; ValueError if empty, not 1-D or out of vocab."""
    tensor = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(list(ids), dtype=torch.long)
    if tensor.dim() == 2 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 1:
        raise ValueError(
            f"{what} must be a 1-D sequence of token ids, got shape {tuple(tensor.shape)}"
        )
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise ValueError(f"{what} must hold integer token ids, got dtype {tensor.dtype}")
    if tensor.numel() == 0:
        raise ValueError(f"{what} is empty; it needs at least one token")
    low, high = int(tensor.min()), int(tensor.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"{what} holds ids outside the vocabulary [0, {vocab_size}): min {low}, max {high}; "
            "tokenize with the checkpoint's own tokenizer"
        )
    return tensor.long()


def check_positions(spec: StateSpec, num_positions: int, *, what: str) -> None:
    """Positions beyond the model's range are an error unless the config scales RoPE."""
    if spec.max_positions is not None and num_positions > spec.max_positions:
        raise ValueError(
            f"{what} needs {num_positions} positions but the model's max_position_embeddings is "
            f"{spec.max_positions} and its config has no RoPE scaling; shorten the input or load the "
            "checkpoint with a `rope_parameters` scaling (e.g. rope_type='yarn' with a factor)"
        )
