"""Multi-turn rollout: assistant turns sampled from the prompt state + the branch's own state, an
environment's observations fed in between.

Legend: P prompt tokens, R branch tokens.

The reference is one plain transformers forward over prompt + branch: the sampler's log-prob of
every sampled token must be what that forward gives at its position (so the branch cache saw
exactly the tokens recorded, observations and framing included), and given tokens must carry
loss mask 0. GLM-5's reference forward picks its DSA top-k with the engine's stable tie rule
(`transformers_stable_topk`, as every GLM-5 comparison does). Environment failures end a branch, never the rollout.
"""

from __future__ import annotations

import time

import pytest
import torch
from dsa_reference import transformers_stable_topk

from longstraw.data.trajectory import ChatFraming
from longstraw.engine.agent_rollout import TurnLimits, sample_agent_branch, sample_agent_group
from longstraw.engine.prefill import prefill
from longstraw.engine.rollout import SamplingParams
from tests.conftest import ENGINE_FAMILIES
from tests.engine.engine_helpers import assert_close, full_sequence_logprobs, random_ids

PROMPT_LEN = 40
SHARD_TOKENS = 13
# Sampler: one multi-token forward per observation and one per sampled token; the reference:
# one forward over the whole sequence. Same fp32 math in another order.
LOGP_ATOL = 2e-5


class ScriptedEnvironment:
    """Answers every turn with a fixed observation; done after `turns` turns with a reward."""

    def __init__(self, observations=("Key 07 has value 8.", "ok"), turns: int = 3):
        self.observations, self.turns = observations, turns
        self.seen: list[str] = []
        self.metadata = None

    def reset(self, metadata):
        self.metadata, self.seen = metadata, []

    def step(self, text):
        self.seen.append(text)
        done = len(self.seen) >= self.turns
        return (
            self.observations[(len(self.seen) - 1) % len(self.observations)],
            done,
            (0.75 if done else None),
        )


def _state(model):
    vocab = model.config.vocab_size
    # Tokens 0-2 are the special tokens: keep the prompt to ordinary ones.
    prompt = random_ids(PROMPT_LEN, vocab - 3) + 3
    return prompt, prefill(model, prompt, shard_tokens=SHARD_TOKENS)


def _limits(**overrides) -> TurnLimits:
    return TurnLimits(
        **({"max_turns": 3, "max_turn_tokens": 4, "max_branch_tokens": 80} | overrides)
    )


PARAMS = SamplingParams(num_samples=1, max_new_tokens=1, temperature=0.9)


@pytest.mark.parametrize("family", [*ENGINE_FAMILIES, "glm_moe_dsa"])
def test_sampler_logprobs_equal_a_full_forward_over_the_trajectory(
    family, tiny_model, load_tokenizer
):
    model, tokenizer = tiny_model(family), load_tokenizer(family)
    framing = ChatFraming.from_tokenizer(tokenizer)
    prompt, state = _state(model)
    env = ScriptedEnvironment()
    traj = sample_agent_branch(
        model,
        state,
        env,
        {"answer": "8"},
        framing,
        _limits(),
        PARAMS,
        generator=torch.Generator().manual_seed(3),
        tokenizer=tokenizer,
    )
    assert traj.finish_reason == "done" and traj.reward == 0.75 and traj.error is None
    assert env.metadata == {"answer": "8"} and env.seen == traj.turns
    assert len(traj.turns) == 3 and traj.observations == ["Key 07 has value 8.", "ok"]
    assert len(traj.token_ids) == len(traj.loss_mask) == len(traj.logprobs)
    # Given tokens are exactly the framing + observations, in order, between the turns.
    ids = traj.token_ids
    mask = torch.tensor(traj.loss_mask)
    given = [t for t, m in zip(ids, traj.loss_mask, strict=True) if m == 0]
    expected_given = []
    sampled_turns = _runs(ids, traj.loss_mask)
    for turn_ids, obs in zip(sampled_turns, traj.observations, strict=False):
        stop = turn_ids[-1] if turn_ids[-1] in framing.turn_stop_ids else None
        expected_given += framing.close_turn(stop) + framing.observation(obs)
    assert given == expected_given
    with transformers_stable_topk():
        reference = full_sequence_logprobs(
            model, prompt, torch.tensor(ids), temperature=PARAMS.temperature
        )
    sampled = mask.bool()
    assert_close(
        torch.tensor(traj.logprobs)[sampled],
        reference[sampled],
        atol=LOGP_ATOL,
        rtol=0,
        what="sampler log-probs",
    )
    assert torch.all(torch.tensor(traj.logprobs)[~sampled] == 0)


def _runs(ids, mask):
    """The maximal runs of sampled tokens (one per assistant turn)."""
    runs, current = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


class EveryTokenStops:
    """A framing under which any sampled token ends the turn; records what close_turn got."""

    def __init__(self, framing: ChatFraming, vocab: int):
        self.framing, self.turn_stop_ids, self.closed = framing, tuple(range(vocab)), []

    def close_turn(self, stop_id):
        self.closed.append(stop_id)
        return self.framing.close_turn(stop_id)

    def observation(self, text):
        return self.framing.observation(text)


def test_a_turn_ends_at_a_turn_stop_token(tiny_model, load_tokenizer):
    model, tokenizer = tiny_model("qwen3_5"), load_tokenizer("qwen3_5")
    framing = EveryTokenStops(ChatFraming.from_tokenizer(tokenizer), model.config.vocab_size)
    prompt, state = _state(model)
    traj = sample_agent_branch(
        model,
        state,
        ScriptedEnvironment(turns=3),
        {},
        framing,
        _limits(max_turn_tokens=6),
        PARAMS,
        generator=torch.Generator().manual_seed(1),
        tokenizer=tokenizer,
    )
    turns = _runs(traj.token_ids, traj.loss_mask)
    assert traj.finish_reason == "done" and [len(t) for t in turns] == [1, 1, 1]
    assert framing.closed == [turns[0][0], turns[1][0]]  # each stop token handed to the framing
    reference = full_sequence_logprobs(model, prompt, torch.tensor(traj.token_ids), temperature=0.9)
    sampled = torch.tensor(traj.loss_mask).bool()
    assert_close(
        torch.tensor(traj.logprobs)[sampled],
        reference[sampled],
        atol=LOGP_ATOL,
        rtol=0,
        what="sampler log-probs",
    )


class RaisingEnvironment(ScriptedEnvironment):
    def step(self, text):
        raise RuntimeError("tool crashed")


class HangingEnvironment(ScriptedEnvironment):
    def step(self, text):
        time.sleep(30)
        return "late", True, 1.0


class BrokenReset(ScriptedEnvironment):
    def reset(self, metadata):
        raise KeyError("answer")


class BadReturn(ScriptedEnvironment):
    def step(self, text):
        return "only an observation"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (RaisingEnvironment(), "step: RuntimeError: tool crashed"),
        (HangingEnvironment(), "step: EnvironmentTimeout: no answer within 0.5 s"),
        (BrokenReset(), "reset: KeyError: 'answer'"),
        (BadReturn(), "step: TypeError: Environment.step must return"),
    ],
)
def test_an_environment_failure_ends_its_branch_with_the_error(
    env, message, tiny_model, load_tokenizer
):
    model, tokenizer = tiny_model("llama"), load_tokenizer("llama")
    _, state = _state(model)
    started = time.perf_counter()
    traj = sample_agent_branch(
        model,
        state,
        env,
        {},
        ChatFraming.from_tokenizer(tokenizer),
        _limits(step_timeout_s=0.5),
        PARAMS,
        generator=torch.Generator().manual_seed(0),
        tokenizer=tokenizer,
    )
    assert time.perf_counter() - started < 20  # the hanging call was not waited for
    assert traj.finish_reason == "error" and traj.error.startswith(message), traj.error
    assert traj.reward is None
    assert len(traj.token_ids) == len(traj.loss_mask) == len(traj.logprobs)


def test_an_observation_past_the_budget_ends_the_branch_as_truncated(tiny_model, load_tokenizer):
    model, tokenizer = tiny_model("qwen3"), load_tokenizer("qwen3")
    framing = ChatFraming.from_tokenizer(tokenizer)
    _, state = _state(model)
    long_observation = "record " * 40
    traj = sample_agent_branch(
        model,
        state,
        ScriptedEnvironment(observations=(long_observation,)),
        {},
        framing,
        _limits(max_branch_tokens=30),
        PARAMS,
        generator=torch.Generator().manual_seed(0),
        tokenizer=tokenizer,
    )
    assert traj.finish_reason == "length" and traj.truncated
    assert traj.observations == [] and all(traj.loss_mask)  # nothing given was appended
    assert len(traj.token_ids) <= 30


def test_max_turns_without_done(tiny_model, load_tokenizer):
    model, tokenizer = tiny_model("llama"), load_tokenizer("llama")
    _, state = _state(model)
    group = sample_agent_group(
        model,
        state,
        lambda: ScriptedEnvironment(turns=99),
        {},
        ChatFraming.from_tokenizer(tokenizer),
        _limits(max_turns=2),
        SamplingParams(num_samples=3, max_new_tokens=1),
        generator=torch.Generator().manual_seed(0),
        tokenizer=tokenizer,
    )
    assert [t.finish_reason for t in group] == ["max_turns"] * 3
    assert all(len(t.turns) == 2 and t.reward is None for t in group)
    # Three fresh environments, three different samples from one prompt state.
    assert len({tuple(t.token_ids) for t in group}) > 1


def test_turn_limits_are_checked():
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        TurnLimits(max_turns=0, max_turn_tokens=1, max_branch_tokens=1)
    with pytest.raises(ValueError, match="step_timeout_s must be > 0"):
        TurnLimits(max_turns=1, max_turn_tokens=1, max_branch_tokens=1, step_timeout_s=0)
