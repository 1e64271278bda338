"""Responses generated elsewhere (vLLM, SGLang, …), read from JSONL and trained on here.

Each record names the policy version that sampled it: training on responses of another version is
an error, not a silent off-policy update. Records with `sampler_logprobs` get TRL's truncated
importance weight per token (`GRPOConfig.vllm_importance_sampling_correction`), computed against
this trainer's no-grad replay of the same tokens on the same prompt state.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from longstraw.data.jsonl import ResponseRecord, read_response_file
from longstraw.engine.rollout import Response, score_responses
from longstraw.engine.state import PrefixState
from longstraw.grpo.losses import importance_weights


class ImportedResponses:
    """Response records of a JSONL file, grouped by prompt id."""

    def __init__(self, path: str, tokenizer, *, prompt_ids: set[str] | None = None):
        self.path = path
        self.tokenizer = tokenizer
        self.by_prompt: dict[str, list[ResponseRecord]] = defaultdict(list)
        for record in read_response_file(path, prompt_ids=prompt_ids):
            self.by_prompt[record.prompt_id].append(record)

    def group(self, prompt_id: str, policy_version: int) -> list[Response]:
        """The group of `prompt_id`; ValueError when missing or sampled by another version."""
        records = self.by_prompt.get(prompt_id)
        if not records:
            raise ValueError(f"{self.path} has no responses for prompt {prompt_id!r}")
        responses = []
        for i, record in enumerate(records):
            if record.policy_version != policy_version:
                raise ValueError(
                    f"{self.path}: response {i} of prompt {prompt_id!r} was sampled by policy version "
                    f"{record.policy_version}, the model being trained is at version {policy_version}; "
                    "regenerate the responses with the current checkpoint"
                )
            ids = record.response_ids
            if ids is None:
                ids = self.tokenizer.encode(record.response, add_special_tokens=False)
            text = record.response
            if text is None and self.tokenizer is not None:
                text = self.tokenizer.decode(ids)
            responses.append(
                Response(
                    token_ids=list(ids),
                    logprobs=list(record.sampler_logprobs or []),
                    finish_reason="stop",
                    text=text,
                    metadata={"imported": True},
                )
            )
        return responses


def imported_importance_weights(
    model,
    state: PrefixState,
    responses: list[Response],
    *,
    temperature: float,
    cap: float,
    score=score_responses,
) -> list[torch.Tensor] | None:
    """[G][R_i] truncated importance weights, or None when no response has sampler log-probs.

    `score(model, state, ids, temperature=)` gives this trainer's no-grad log-probs (a rank's
    sharded scoring on a sequence-sharded state)."""
    if not any(r.logprobs for r in responses):
        return None
    if not all(len(r.logprobs) == len(r.token_ids) for r in responses):
        raise ValueError(
            "either every imported response of a group carries sampler_logprobs or none does"
        )
    trainer = score(model, state, [r.token_ids for r in responses], temperature=temperature)
    return [
        importance_weights(t, torch.tensor(r.logprobs, dtype=torch.float64), cap).float()
        for t, r in zip(trainer, responses, strict=True)
    ]
