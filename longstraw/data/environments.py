"""Environments an agent acts in during rollout, and the registry that names them.

An environment is any class with

    reset(metadata: dict) -> None
    step(assistant_text: str) -> tuple[str, bool, float | None]   # observation, done, reward

and, optionally, a `system_prompt` string (the instructions the prompt starts with). A run names
one in `agent.environment`: a registered name (`key_lookup`, `calculator`) or
`package.module:Class`; `agent.environment_args` are passed to its constructor. One instance
serves one trajectory (reset, then a step per assistant turn).

Two ship here. `KeyLookupEnvironment` is a tool over the haystack prompt: the agent asks for a
key (`lookup 07`), the tool answers from the prompt's own records (`Key 07 has value 8.`), and
a turn that asks for nothing is the answer, scored by the haystack rewards.
`CalculatorEnvironment` evaluates arithmetic (`calc 12*(3+4)`) and scores a final numeric
answer against the task's `answer`.
"""

from __future__ import annotations

import ast
import importlib
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from longstraw.data.rewards import haystack_exact, haystack_shaped
from longstraw.errors import UserError

_ENVIRONMENTS: dict[str, type] = {}


def register_environment(name: str) -> Callable[[type], type]:
    """Register an environment class under `name` (the value `agent.environment` may take)."""

    def decorator(cls: type) -> type:
        if name in _ENVIRONMENTS and _ENVIRONMENTS[name] is not cls:
            raise ValueError(f"environment {name!r} is already registered; pick another name")
        _ENVIRONMENTS[name] = cls
        return cls

    return decorator


def environment_names() -> list[str]:
    return sorted(_ENVIRONMENTS)


def environment_class(spec: str) -> type:
    """The class `spec` names: a registered name or `package.module:Class`."""
    if spec in _ENVIRONMENTS:
        return _ENVIRONMENTS[spec]
    if ":" not in spec:
        raise UserError(
            f"unknown environment {spec!r}; use one of {environment_names()} or "
            "'package.module:Class'"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"environment {spec!r}: cannot import {module_name!r} ({exc})") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise UserError(f"environment {spec!r}: module {module_name!r} has no {attr!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise UserError(
            f"environment {spec!r} lacks {', '.join(missing)}; an environment defines "
            "reset(metadata) and step(assistant_text) -> (observation, done, reward)"
        )
    return cls


def environment_factory(spec: str, args: dict[str, Any] | None = None) -> Callable[[], Any]:
    """A function that makes a fresh environment per trajectory; bad `args` fail here, once."""
    cls = environment_class(spec)
    args = dict(args or {})
    try:
        cls(**args)
    except TypeError as exc:
        raise UserError(
            f"environment {spec!r} does not accept agent.environment_args: {exc}"
        ) from None
    return lambda: cls(**args)


def system_prompt(spec: str) -> str | None:
    """The instructions environment `spec` wants at the start of the prompt (or None)."""
    return getattr(environment_class(spec), "system_prompt", None)


# --------------------------------------------------------------------------------------------
# Key lookup over the haystack prompt

_VALUE_RECORD = re.compile(r"Key (\w+) has value (\w+)\.")
_POINTER_RECORD = re.compile(r"Key (\w+) points to key (\w+)\.")
_LOOKUP = re.compile(r"lookup\W*(\w+)", re.IGNORECASE)


@register_environment("key_lookup")
class KeyLookupEnvironment:
    """A lookup tool over the records of the haystack prompt.

    The table is every record of the prompt text (`metadata["prompt_text"]`, which the trainer
    passes when the prompt is short enough to keep as text) and always the task's needle
    records. A turn containing `lookup KEY` gets the record of KEY (or "no record") and goes on;
    any other turn is the answer: done, scored by `reward` ("haystack_shaped": 1 for the exact
    value, up to 0.5 for answering in the value alphabet; or "haystack_exact").
    `queries_before_answer` turns are always treated as lookups (the first key-like word is
    looked up), so every trajectory has that many tool rounds.
    """

    system_prompt = (
        "You can look up the records of the document. To look up a key, reply with "
        "'lookup KEY'; the tool answers with that key's record. When you know the answer, "
        "reply with the value alone."
    )

    def __init__(self, reward: str = "haystack_shaped", queries_before_answer: int = 0):
        if reward not in ("haystack_shaped", "haystack_exact"):
            raise TypeError(f"reward must be 'haystack_shaped' or 'haystack_exact', got {reward!r}")
        if queries_before_answer < 0:
            raise TypeError(f"queries_before_answer must be >= 0, got {queries_before_answer}")
        self.score = haystack_shaped if reward == "haystack_shaped" else haystack_exact
        self.queries_before_answer = queries_before_answer
        self.metadata: dict = {}
        self.records: dict[str, str] = {}
        self.turns = 0

    def reset(self, metadata: dict) -> None:
        self.metadata, self.turns = dict(metadata), 0
        text = metadata.get("prompt_text") or ""
        records = {}
        for match in _VALUE_RECORD.finditer(text):
            records.setdefault(match.group(1), match.group(0))
        for match in _POINTER_RECORD.finditer(text):
            records.setdefault(match.group(1), match.group(0))
        for needle in metadata.get("needles", ()):
            records[needle["key"]] = needle["text"].strip()
        self.records = records

    def _answer_lookup(self, key: str | None) -> str:
        if key is None:
            return "No key given. Reply with 'lookup KEY'."
        return self.records.get(key, f"No record for key {key}.")

    def step(self, assistant_text: str) -> tuple[str, bool, float | None]:
        self.turns += 1
        asked = _LOOKUP.search(assistant_text)
        if self.turns <= self.queries_before_answer:
            words = re.findall(r"\w+", assistant_text)
            key = asked.group(1) if asked else next(iter(words), None)
            return self._answer_lookup(key), False, None
        if asked:
            return self._answer_lookup(asked.group(1)), False, None
        return "", True, self.score("", assistant_text, self.metadata)


# --------------------------------------------------------------------------------------------
# Calculator

_OPERATORS: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_MAX_EXPONENT = 64
_MAX_EXPRESSION = 200


def evaluate_arithmetic(expression: str) -> float:
    """The value of an arithmetic expression of numbers, + - * / // % ** and parentheses.

    Parsed with `ast`, never `eval`; ValueError for anything else, a division by zero, an
    exponent above 64 or an expression over 200 characters.
    """
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} above {_MAX_EXPONENT}")
            try:
                return _OPERATORS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    result = value(tree.body)
    if isinstance(result, complex) or not math.isfinite(result):
        raise ValueError(f"{expression!r} has no finite real value")
    return result


def _format_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.10g}"


_CALC = re.compile(r"calc\W*(.+)", re.IGNORECASE | re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@register_environment("calculator")
class CalculatorEnvironment:
    """An arithmetic tool: `calc EXPR` is evaluated and answered (`= 84`, or the error); any
    other turn is the answer: done, reward 1.0 if its first number equals the task's
    `metadata["answer"]` (within `tolerance`), else 0.0."""

    system_prompt = (
        "You have a calculator. To compute, reply with 'calc EXPRESSION' (numbers, + - * / ** "
        "and parentheses); the tool answers with the result. Reply with the number alone when "
        "you know the answer."
    )

    def __init__(self, tolerance: float = 1e-6):
        if tolerance < 0:
            raise TypeError(f"tolerance must be >= 0, got {tolerance}")
        self.tolerance = tolerance
        self.expected: float | None = None

    def reset(self, metadata: dict) -> None:
        answer = metadata.get("answer")
        try:
            self.expected = None if answer is None else float(answer)
        except (TypeError, ValueError):
            raise ValueError(f"the task's answer {answer!r} is not a number") from None

    def step(self, assistant_text: str) -> tuple[str, bool, float | None]:
        asked = _CALC.search(assistant_text)
        if asked:
            try:
                return f"= {_format_number(evaluate_arithmetic(asked.group(1)))}", False, None
            except ValueError as exc:
                return f"error: {exc}", False, None
        found = _NUMBER.search(assistant_text)
        if found is None or self.expected is None:
            return "", True, 0.0
        return "", True, float(abs(float(found.group(0)) - self.expected) <= self.tolerance)
