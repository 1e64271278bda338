"""bench/bench_learning.py's own arithmetic: the pre-training targets are the values of repeated
records and the answer, the guessing floor is the exact expectation of copying a random record's
value, P* follows its rule, and the learning curves split a run's evaluation by length."""

from __future__ import annotations

import random
import re

import pytest

from longstraw.data.haystack import generate_haystack_task
from longstraw.models.tokenizer import build_hf_tokenizer

PLAN = {
    "p_train": 200,
    "task": {
        "variant": "kv_retrieval",
        "record_format": "compact",
        "key_length": 2,
        "key_alphabet": "123456789",
        "value_length": 2,
        "value_alphabet": "123456789",
        "num_distinct_distractors": 12,
        "distractor_fraction": 0.7,
        "include_header": False,
    },
}


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("bench_learning")


@pytest.fixture(scope="module")
def tokenizer():
    return build_hf_tokenizer(512)


@pytest.mark.parametrize("seed", [42, 7, 1000])
def test_targets_are_the_values_of_repeated_records_and_the_answer(bench, tokenizer, seed):
    ids, mask, answer = bench.training_example(PLAN, {}, seed, tokenizer)
    example = generate_haystack_task(bench.task_config(PLAN, 200, seed), tokenizer)
    assert answer == len(example.answer_ids) == 2
    assert ids[:200].tolist() == example.prompt_ids.tolist()
    assert ids[200:].tolist() == example.answer_ids.tolist()
    # The test's own reading of the text: a record's value is a target iff its key came before.
    seen, expected = set(), []
    for k in example.piece_sequence.tolist()[:-1]:
        match = re.fullmatch(r"Key (\w+): (\w+)\n", example.piece_texts[k])
        if match and match.group(1) in seen:
            expected.append(" " + match.group(2))
        if match:
            seen.add(match.group(1))
    targets, run = [], []
    for i, flag in enumerate(mask[:200].tolist()):
        if flag:
            run.append(int(ids[i]))
        elif run:
            targets.append(tokenizer.decode(run))
            run = []
    assert targets == expected and len(expected) > 3
    assert mask[200:].tolist() == [1.0, 1.0]


def test_guessing_floor_is_the_expectation_of_copying_a_random_record(bench, tokenizer):
    example = generate_haystack_task(bench.task_config(PLAN, 400, 3), tokenizer)
    floor = bench.guessing_floor(example)
    records = re.findall(r"^Key (\w+): (\w+)$", example.prompt_text(), flags=re.MULTILINE)
    assert floor["records"] == len(records)
    assert floor["distinct_records"] == len(set(records)) > 5
    rng = random.Random(0)
    draws = 200_000
    per_line = sum(rng.choice(records)[1] == example.answer for _ in range(draws)) / draws
    distinct = sorted(set(records))
    per_record = sum(rng.choice(distinct)[1] == example.answer for _ in range(draws)) / draws
    # Monte Carlo standard error at these rates is below 1e-3.
    assert floor["per_line"] == pytest.approx(per_line, abs=4e-3)
    assert floor["per_record"] == pytest.approx(per_record, abs=4e-3)
    assert floor["per_record"] >= 1 / len(set(records))  # the needle's own record


def test_target_length_is_the_shortest_in_the_band_and_above_the_floor(bench):
    rule = {"low": 0.1, "high": 0.5, "margin": 0.1}

    def row(p, accuracy, floor):
        return {"prompt_tokens": p, "summary": {"accuracy": accuracy, "floor": floor}}

    rows = [row(256, 0.95, 0.06), row(512, 0.6, 0.05), row(1024, 0.3, 0.25),
            row(2048, 0.2, 0.05), row(4096, 0.12, 0.04)]  # fmt: skip
    assert bench.choose_target_length(rows, rule) == 2048  # 1024 is in the band, too near its floor
    assert bench.choose_target_length(rows[:3], rule) is None


def test_curves_split_each_evaluation_by_prompt_length(bench):
    base = {"rows": [{"prompt_tokens": 8, "summary": {"accuracy": 0.25}},
                     {"prompt_tokens": 16, "summary": {"accuracy": 0.0}}]}  # fmt: skip
    rows = [
        {"step": 0, "step_seconds": 3.0, "seconds": {"eval": 1.0}, "reward_mean": 0.1},
        {"step": 1, "step_seconds": 5.0, "seconds": {"eval": 2.0, "checkpoint": 0.5},
         "reward_mean": 0.2,
         "eval": {"rewards": [[1.0], [0.0], [1.0], [1.0], [0.0], [0.0]]}},
    ]  # fmt: skip
    record = {"mode": "exact", "seed": 0, "eval_lengths": [8, 8, 8, 16, 16, 16], "rows": rows}
    data = bench.curves([record], base, 8)["exact"]
    assert data["steps"] == [0, 2]
    assert data["seconds"] == [[0.0, 2.0 + 2.5]]
    assert data["accuracy"][8] == [[0.25, 2 / 3]]
    assert data["accuracy"][16] == [[0.0, 1 / 3]]
    assert data["reward"] == [[0.1, 0.2]]


def test_verdict_calls_a_difference_only_beyond_two_standard_errors(bench):
    clear = bench.verdict([0.60, 0.62, 0.61], [0.40, 0.42, 0.41], prompts=200)
    assert clear["verdict"] == "exact learns more"
    # The seeds agree to 0.01, so the binomial error of 200 prompts per seed sets the resolution.
    assert clear["se"] == pytest.approx(clear["binomial_se"])
    assert clear["binomial_se"] == pytest.approx((0.51 * 0.49 / 200 * (2 / 3)) ** 0.5)
    assert bench.verdict([0.45, 0.30, 0.60], [0.40, 0.41, 0.42], 200)["verdict"] == (
        "no difference at this resolution"
    )
    assert bench.verdict([0.1, 0.1, 0.1], [0.3, 0.3, 0.3], 200)["verdict"] == "detached learns more"
