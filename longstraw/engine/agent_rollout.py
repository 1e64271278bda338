"""Multi-turn rollout: an agent's turns sampled from the prompt state, an environment's outputs
appended between them.

One branch at a time: the branch's cache reads the shared prompt state (nothing of prompt size
is copied) and keeps the branch's own K/V / recurrent state as it grows. An assistant turn is
decoded until a turn-stop token or its token cap; the environment gets the turn's text and
answers with an observation, which is fed through the model in one forward (its tokens are
given, not sampled: loss mask 0) together with the chat template's framing around it; then the
next turn is decoded, until the environment says done, `max_turns`, or the branch's token
budget. The branch tokens are kept exactly as sampled (token in, token out): nothing is
re-tokenized from text, so training replays the very ids the sampler drew.

An environment that raises or does not answer within `step_timeout_s` ends its branch with the
error recorded (`AgentTrajectory.error`); the step goes on. A timed-out call keeps running on
its daemon thread (Python cannot stop a thread); its result is ignored.

Branches are decoded one after another rather than as one batch: after the first observation
the branches differ in length, and the branch cache advances one position counter for all rows.

On the ranks of a sequence group (`exchange` a `CrossRankExchange`, `state` this rank's slice)
every rank decodes the same turns, as the ranks' rollout does; the environment lives on the
group's first rank only (a tool call runs once, not once per rank), and each of its answers —
or its error — is handed to every rank, so all ranks feed the same observations.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel

from longstraw.engine.exchange import LOCAL, PrefixExchange
from longstraw.engine.replay import decoding_cache, replay_logits
from longstraw.engine.rollout import SamplingParams, decode, decode_response
from longstraw.engine.state import PrefixState
from longstraw.engine.validation import check_positions


class Environment(Protocol):
    """What a user environment implements (loaded by `package.module:Class`)."""

    def reset(self, metadata: dict) -> None:
        """Start an episode for the prompt whose task metadata is `metadata`."""

    def step(self, assistant_text: str) -> tuple[str, bool, float | None]:
        """React to one assistant turn: (observation text, done, reward or None)."""


class TurnFraming(Protocol):
    """The chat template's tokens around turns (`longstraw.data.trajectory.ChatFraming`)."""

    turn_stop_ids: tuple[int, ...]
    """Tokens that end an assistant turn when sampled (kept in the turn: they are trained)."""

    def close_turn(self, stop_id: int | None) -> list[int]:
        """Tokens the template puts after a turn that ended with `stop_id` (None: cut at its
        token cap, so the turn's end marker itself is appended too)."""

    def observation(self, text: str) -> list[int]:
        """The tokens of an environment message `text` with its framing, up to and including
        the header of the next assistant turn."""


@dataclass(frozen=True)
class TurnLimits:
    """How long an agent branch may run."""

    max_turns: int
    """Assistant turns per branch."""
    max_turn_tokens: int
    """Tokens one assistant turn may sample."""
    max_branch_tokens: int
    """Tokens of the whole branch: assistant turns, observations and framing."""
    step_timeout_s: float = 30.0
    """Longest wait for one `Environment.step` (or `reset`)."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_branch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")


@dataclass
class AgentTrajectory:
    """One branch of a group: what training replays, and what happened."""

    token_ids: list[int] = field(default_factory=list)
    """[R] the branch after the prompt: assistant turns, framing, observations."""
    loss_mask: list[int] = field(default_factory=list)
    """[R] 1 on sampled (assistant) tokens, 0 on given ones."""
    logprobs: list[float] = field(default_factory=list)
    """[R] sampler log-probs of the sampled tokens; 0.0 on given tokens."""
    turns: list[str] = field(default_factory=list)
    """The assistant turns' texts."""
    observations: list[str] = field(default_factory=list)
    """The environment's answers, in order."""
    reward: float | None = None
    """The environment's reward (the last one it gave); None if it gave none."""
    finish_reason: str = "max_turns"
    """"done" (the environment ended it), "max_turns", "length" (token budget: truncated) or
    "error" (the environment raised or timed out)."""
    error: str | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def text(self) -> str:
        """The assistant's last turn (what a text reward would score)."""
        return self.turns[-1] if self.turns else ""

    def extend(self, ids: Sequence[int], *, sampled: Sequence[float] | None = None) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if sampled is not None else 0] * len(ids))
        self.logprobs.extend(sampled if sampled is not None else [0.0] * len(ids))


class EnvironmentTimeout(Exception):
    """An environment call that did not return in time."""


def _call(timeout_s: float, fn: Callable, *args):
    """`fn(*args)` on a daemon thread, waited for at most `timeout_s` (a call that hangs is left
    behind: it cannot be stopped, but it cannot hold the process at exit either)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="longstraw-environment", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise EnvironmentTimeout(f"no answer within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _checked_step(result) -> tuple[str, bool, float | None]:
    if not (isinstance(result, tuple) and len(result) == 3):
        raise TypeError(
            f"Environment.step must return (observation: str, done: bool, reward: float | None), "
            f"got {result!r}"
        )
    observation, done, reward = result
    if not isinstance(observation, str):
        raise TypeError(f"observation must be str, got {type(observation).__name__}")
    if reward is not None:
        reward = float(reward)
        if reward != reward or reward in (float("inf"), float("-inf")):
            raise ValueError(f"reward must be finite, got {reward}")
    return observation, bool(done), reward


def _answer(timeout_s: float, fn: Callable, *args) -> tuple[object, str | None]:
    """(result, None) of `fn(*args)` within `timeout_s`, or (None, what went wrong): an answer
    every rank can be handed, whatever the environment did."""
    try:
        return _call(timeout_s, fn, *args), None
    except Exception as exc:  # a user environment may raise anything
        return None, _describe(exc)


def _checked_answer(timeout_s: float, environment, text: str):
    """`environment.step(text)` checked, as (observation, done, reward) or an error."""
    result, error = _answer(timeout_s, environment.step, text)
    if error is not None:
        return None, error
    try:
        return _checked_step(result), None
    except Exception as exc:  # float(reward) / bool(done) of whatever the environment returned
        return None, _describe(exc)


@torch.no_grad()
def sample_agent_branch(
    model: PreTrainedModel,
    state: PrefixState,
    environment: Environment | None,
    metadata: dict,
    framing: TurnFraming,
    limits: TurnLimits,
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    tokenizer=None,
    exchange: PrefixExchange = LOCAL,
) -> AgentTrajectory:
    """One trajectory: turns decoded from `state` + the branch's own state, the environment's
    observations fed in between. `params` gives temperature / top-p / top-k / min-p
    (`num_samples` and `max_new_tokens` are set per turn here). `environment` is used on the
    exchange's leader only (None elsewhere)."""
    check_positions(
        state.spec, state.prompt_len + limits.max_branch_tokens, what="prompt + branch budget"
    )
    cache = decoding_cache(state, exchange, batch_size=1, branch_capacity=limits.max_branch_tokens)
    trajectory = AgentTrajectory()
    timeout = limits.step_timeout_s

    def next_logits(tokens_1N: torch.Tensor) -> torch.Tensor:
        logits_1V = replay_logits(model, state, tokens_1N, cache, exchange)[:, -1]
        cache.position_offset += tokens_1N.shape[1]
        return logits_1V

    pending = [state.last_token_id]  # fed before the next turn is decoded
    with exchange.layers.attention_enabled(model):
        _, error = exchange.collectives.on_leader(
            lambda: _answer(timeout, environment.reset, metadata)
        )
        if error is not None:
            trajectory.finish_reason, trajectory.error = "error", f"reset: {error}"
            return trajectory
        for _ in range(limits.max_turns):
            room = limits.max_branch_tokens - len(trajectory.token_ids)
            if room < 1:
                trajectory.finish_reason = "length"
                break
            turn_params = SamplingParams(
                num_samples=1,
                max_new_tokens=min(limits.max_turn_tokens, room),
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                min_p=params.min_p,
                stop_token_ids=tuple(framing.turn_stop_ids) + tuple(params.stop_token_ids),
            )
            first = torch.tensor([pending], dtype=torch.long, device=model.device)
            (turn,) = decode(
                next_logits, first, turn_params, generator=generator,
                after_draw=exchange.collectives.check_draws,
            )  # fmt: skip
            trajectory.extend(turn.token_ids, sampled=turn.logprobs)
            text = decode_response(tokenizer, turn.token_ids) if tokenizer is not None else ""
            trajectory.turns.append(text)
            answer, error = exchange.collectives.on_leader(
                lambda text=text: _checked_answer(timeout, environment, text)
            )
            if error is not None:
                trajectory.finish_reason, trajectory.error = "error", f"step: {error}"
                break
            observation, done, reward = answer
            if reward is not None:
                trajectory.reward = reward
            if done:
                trajectory.finish_reason = "done"
                break
            stop = turn.token_ids[-1] if turn.finish_reason == "stop" else None
            given = framing.close_turn(stop) + framing.observation(observation)
            # The observation must fit with room for at least one sampled token after it.
            if len(trajectory.token_ids) + len(given) + 1 > limits.max_branch_tokens:
                trajectory.finish_reason = "length"
                break
            trajectory.observations.append(observation)
            trajectory.extend(given)
            # The turn's last sampled token was never fed (decode stops before feeding it).
            pending = [turn.token_ids[-1], *given]
        else:
            trajectory.finish_reason = "max_turns"
    return trajectory


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _made_on_leader(make_environment: Callable[[], Environment], exchange: PrefixExchange):
    """A fresh environment on the exchange's leader (None elsewhere). A constructor that raises
    fails every rank: the leader with its exception, the others naming it."""
    made: dict = {}

    def make() -> str | None:
        try:
            made["environment"] = make_environment()
        except Exception as exc:
            made["error"] = exc
            return _describe(exc)
        return None

    error = exchange.collectives.on_leader(make)
    if "error" in made:
        raise made["error"]
    if error is not None:
        raise RuntimeError(f"the environment could not be made on the first rank: {error}")
    return made.get("environment")


def sample_agent_group(
    model: PreTrainedModel,
    state: PrefixState,
    make_environment: Callable[[], Environment],
    metadata: dict,
    framing: TurnFraming,
    limits: TurnLimits,
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    tokenizer=None,
    exchange: PrefixExchange = LOCAL,
) -> list[AgentTrajectory]:
    """`params.num_samples` trajectories, each with a fresh environment from `make_environment`
    (made on the exchange's leader only)."""
    return [
        sample_agent_branch(
            model,
            state,
            _made_on_leader(make_environment, exchange),
            metadata,
            framing,
            limits,
            params,
            generator=generator,
            tokenizer=tokenizer,
            exchange=exchange,
        )
        for _ in range(params.num_samples)
    ]
