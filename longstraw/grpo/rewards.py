"""Reward functions: the one registry by name, user functions by `package.module:function`.

A reward function scores one response: `(prompt: str, response: str, metadata: dict) -> float`.
This module owns the registry: `register_reward(name, fn)` (or `@register_reward(name)`) adds a
function, `get_reward(name)` looks it up. Nothing registers by being imported: the built-in task
rewards are registered by an explicit call, `longstraw.data.rewards.register_haystack_rewards()`,
which the trainer makes before it scores; users point a run at their own function with the spec
"package.module:function" instead. No torch here.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from longstraw.errors import UserError

RewardFn = Callable[[str, str, dict], float]

# Reward name -> function. Private: add with register_reward, read with get_reward / reward_names.
_REWARDS: dict[str, RewardFn] = {}

_BUILTIN_HINT = (
    "the built-in haystack rewards are registered by longstraw.data.rewards."
    "register_haystack_rewards()"
)


def register_reward(name: str, fn: RewardFn | None = None) -> Any:
    """Register `fn` as reward `name` and return it; without `fn`, a decorator that does so.

    Names contain no ':' (that marks 'package.module:function' specs). Registering the same
    function object twice is allowed (a repeated registration call); a different one is not.
    """
    if not name or ":" in name:
        raise ValueError(f"reward name {name!r} must be non-empty and contain no ':'")

    def decorate(fn: RewardFn) -> RewardFn:
        previous = _REWARDS.get(name)
        if previous is not None and previous is not fn:
            raise ValueError(
                f"reward {name!r} is already registered by {_describe(previous)}; pick another name"
            )
        _REWARDS[name] = fn
        return fn

    return decorate if fn is None else decorate(fn)


def reward_names() -> list[str]:
    """The registered reward names, sorted."""
    return sorted(_REWARDS)


def _describe(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _import_user_reward(spec: str) -> RewardFn:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"reward spec {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ValueError(
            f"reward spec {spec!r}: cannot import module {module_name!r} ({err}); check the name and "
            "that its package is installed, on sys.path, or beside the run's config file"
        ) from err
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"reward spec {spec!r}: module {module_name!r} has no attribute {attr_path!r}; "
                "check the function name after ':'"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(
            f"reward spec {spec!r}: {attr_path!r} is a {type(obj).__name__}, not a function; point "
            "at a callable (prompt, response, metadata) -> float"
        )
    return obj


def get_reward(spec: str | RewardFn) -> RewardFn:
    """The reward function for a registered name, a 'package.module:function' spec, or a callable."""
    if callable(spec):
        return spec
    if ":" in spec:
        return _import_user_reward(spec)
    try:
        return _REWARDS[spec]
    except KeyError:
        raise ValueError(
            f"unknown reward {spec!r} (registered rewards: {reward_names()}; {_BUILTIN_HINT}); "
            "register it with register_reward(name, fn) or give a user function as "
            "'package.module:function'"
        ) from None


def _spec_name(spec: str | RewardFn) -> str:
    return spec if isinstance(spec, str) else _describe(spec)


class RewardError(UserError):
    """A reward function raised, or returned something that is not a finite number: names the
    function, the sample, the prompt and the value."""


def _sample_of(sample: int, where: str | None) -> str:
    return f"sample {sample}" + (f" of {where}" if where else "")


def _as_reward_value(value: Any, sample: int, name: str, where: str | None = None) -> float:
    # Numbers, numpy scalars, 0-d tensors and bools (0/1) are accepted; strings and None are not.
    fix = "fix the reward function: it must return a finite number for every response"
    if isinstance(value, (str, bytes)) or value is None:
        ok = False
    else:
        ok = isinstance(value, numbers.Real) or hasattr(value, "__float__")
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    if not ok:
        raise RewardError(
            f"reward function {name!r} returned {shown} ({type(value).__name__}) for "
            f"{_sample_of(sample, where)}; it must return a number — {fix}"
        )
    try:
        result = float(value)
    except (TypeError, ValueError) as err:
        raise RewardError(
            f"reward function {name!r} returned {shown} for {_sample_of(sample, where)}, which is "
            f"not a number — {fix}"
        ) from err
    if not math.isfinite(result):
        raise RewardError(
            f"reward function {name!r} returned {result} for {_sample_of(sample, where)}; rewards "
            f"must be finite — {fix}"
        )
    return result


def _call_reward(
    fn: RewardFn,
    name: str,
    sample: int,
    prompt: str,
    response: str,
    meta: dict,
    where: str | None = None,
):
    try:
        return fn(prompt, response, dict(meta))
    except Exception as err:
        detail = " ".join(str(err).split())
        detail = detail if len(detail) <= 200 else detail[:197] + "..."
        raise RewardError(
            f"reward function {name!r} raised {type(err).__name__}: {detail} on "
            f"{_sample_of(sample, where)} (response {response[:60]!r}) — fix the reward function; "
            "it must return a number for every (prompt, response, metadata) (--debug shows its "
            "traceback)"
        ) from err


def score_group_per_func(
    reward_specs: Sequence[str | RewardFn],
    prompt: str,
    responses: Sequence[str],
    metadata: Mapping[str, Any] | None = None,
    *,
    where: str | None = None,
) -> list[list[float]]:
    """[G][F] reward of each response under each reward function, validated finite numbers.

    `where` names the prompt in errors ("prompt 'q7' (group 0 of step 3)")."""
    if not reward_specs:
        raise ValueError("no reward functions given; pass at least one reward spec")
    fns = [get_reward(s) for s in reward_specs]
    names = [_spec_name(s) for s in reward_specs]
    meta = dict(metadata or {})
    table: list[list[float]] = []
    for i, response in enumerate(responses):
        # Each call gets its own shallow copy: a function that mutates metadata cannot leak into
        # the next sample's score.
        row = [
            _as_reward_value(_call_reward(fn, n, i, prompt, response, meta, where), i, n, where)
            for fn, n in zip(fns, names, strict=True)
        ]
        table.append(row)
    return table


def score_group(
    reward_specs: Sequence[str | RewardFn],
    weights: Sequence[float] | None,
    prompt: str,
    responses: Sequence[str],
    metadata: Mapping[str, Any] | None = None,
    *,
    where: str | None = None,
) -> list[float]:
    """[G] total reward of each response: sum over reward functions of weight * reward.

    `weights` has one entry per spec (None: all 1.0, as TRL). Raises RewardError (a ValueError)
    naming the function, the sample and `where` (the prompt) when a reward raises or is not a
    finite number.
    """
    if weights is not None and len(weights) != len(reward_specs):
        raise ValueError(
            f"got {len(weights)} reward weights for {len(reward_specs)} reward functions; give one "
            "weight per function (GRPOConfig.reward_weights) or none"
        )
    w = [1.0] * len(reward_specs) if weights is None else [float(x) for x in weights]
    table = score_group_per_func(reward_specs, prompt, responses, metadata, where=where)
    return [math.fsum(wf * r for wf, r in zip(w, row, strict=True)) for row in table]
