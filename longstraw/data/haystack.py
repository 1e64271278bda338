"""Needle-in-a-haystack tasks of exact token length, built as a stream of token ids.

Legend: P prompt tokens, N pieces in the prompt, K distinct pieces, T flat token count of
the distinct pieces.

A prompt is a sequence of *pieces* — text lines that each start with a letter and end in "\\n":
a header, prose filler lines, distractor records ("Key 481932 has value 730144."), the needle
records, and the question. Each distinct piece is tokenized once; the prompt is the gather of
their token ids in an order drawn from a seeded numpy Generator, so a 2M-token prompt costs a
few int32 arrays, not millions of Python objects. Because every piece starts with a letter right
after a newline, byte-level BPE pre-tokenizers (GPT-2, Qwen, Llama-3 patterns) never merge
across pieces: the ids equal `encode(prompt_text())`; `check_tokenization` verifies that on
the needles' neighbourhoods and a sample of other boundaries and refuses tokenizers that merge.

Length is exact: the body is drawn greedily until a small remainder is left, which a
coin-change search over the pieces' token lengths fills exactly.
"""

from __future__ import annotations

import itertools
import json

import numpy as np

from longstraw.data.tasks import TaskExample, encode_texts, register_task
from longstraw.schemas.data import HaystackTaskConfig, HaystackVariant

__all__ = ["FILLER_LINES", "HaystackTaskConfig", "HaystackVariant", "generate_haystack_task"]

# Prose filler lines: no digits (keys and values are the only alphanumeric runs that look like
# answers), each a whole line. The short ones give the exact-length search small steps.
FILLER_LINES: tuple[str, ...] = (
    "The river bends twice before it reaches the old mill.\n",
    "Nobody remembers who planted the row of pear trees by the road.\n",
    "A light rain fell through most of the afternoon.\n",
    "The committee postponed its decision until the spring meeting.\n",
    "She kept the letters in a tin box under the stairs.\n",
    "Trains to the coast leave from the far platform on weekdays.\n",
    "The bakery on the corner sells out of rye bread by noon.\n",
    "Several boats were pulled onto the beach before the storm.\n",
    "His notes on the experiment filled three thick notebooks.\n",
    "The library closes early on the last day of each month.\n",
    "Wild thyme grows between the stones of the garden wall.\n",
    "The bridge was painted green after the long repairs.\n",
    "Most visitors arrive by bus and leave before dark.\n",
    "The orchestra rehearsed the slow movement once more.\n",
    "A fox crossed the field at dawn and vanished into the hedge.\n",
    "The museum keeps its oldest maps in a cool dark room.\n",
    "Every window in the hall faces the harbour.\n",
    "The recipe calls for butter, flour, and a pinch of salt.\n",
    "Snow lingered on the northern slopes well into summer.\n",
    "The clerk stamped the form and handed it back without a word.\n",
    "Bees hummed around the lavender near the gate.\n",
    "The old clock in the tower runs a little slow.\n",
    "Fishermen mend their nets on the quay in the evening.\n",
    "The path climbs steeply through the pine forest.\n",
    "Their house has a blue door and a crooked chimney.\n",
    "The market square fills with stalls on market day.\n",
    "A cold wind blew in from the sea all night.\n",
    "The teacher wrote the question on the board and waited.\n",
    "Lanterns were hung along the street for the festival.\n",
    "The ferry was delayed by fog in the morning.\n",
    "Moss covers the north side of the ancient oak.\n",
    "The cat sleeps on the warm stones by the stove.\n",
    "Nothing in the report explained the sudden change.\n",
    "The garden was quiet except for the fountain.\n",
    "A narrow lane leads down to the water.\n",
    "The price of apples rose after the late frost.\n",
    "Yes.\n",
    "Noted.\n",
    "Right.\n",
    "Indeed.\n",
    "Go on.\n",
    "Fine.\n",
    "Agreed.\n",
    "Moving on.\n",
    "Of course.\n",
    "So it goes.\n",
)


def value_record(key: str, value: str, record_format: str = "sentence") -> str:
    """The text of a record that gives `key` a value (`HaystackTaskConfig.record_format`)."""
    if record_format == "compact":
        return f"{compact_record_prefix(key)} {value}\n"
    return f"Key {key} has value {value}.\n"


def compact_record_prefix(key: str) -> str:
    """A compact record up to its value: what a `compact` prompt ends with, to be completed."""
    return f"Key {key}:"


def pointer_record(key: str, target: str) -> str:
    """The text of a record that points `key` at another key (multi-hop chains)."""
    return f"Key {key} points to key {target}.\n"


# --------------------------------------------------------------------------------------------
# Text of the example


def _render(codes_NL: np.ndarray, alphabet: str) -> list[str]:
    """[N, L] character indices -> N strings."""
    table = np.asarray(list(alphabet))
    return ["".join(row) for row in table[codes_NL].tolist()]


def _draw_strings(rng: np.random.Generator, n: int, alphabet: str, length: int) -> list[str]:
    """n strings of `length` characters drawn uniformly from `alphabet` (repeats allowed)."""
    return _render(rng.integers(len(alphabet), size=(n, length)), alphabet)


def _draw_distinct_strings(
    rng: np.random.Generator, n: int, alphabet: str, length: int
) -> list[str]:
    """n distinct strings; exact sampling without replacement when the space is small,
    otherwise rejection of repeats (rare: the space is then > 4n)."""
    base, space = len(alphabet), len(alphabet) ** length
    assert n <= space, (n, space)
    if space <= 4 * n:
        codes = rng.choice(space, size=n, replace=False)
        digits_NL = (codes[:, None] // base ** np.arange(length - 1, -1, -1)) % base
        return _render(digits_NL, alphabet)
    out: dict[str, None] = {}
    while len(out) < n:
        for s in _draw_strings(rng, n - len(out) + 8, alphabet, length):
            out.setdefault(s)
    return list(out)[:n]


def _format_answer(values: list[str], answer_format: str) -> str:
    if answer_format == "json":
        return json.dumps(values[0]) if len(values) == 1 else json.dumps(values)
    return ", ".join(values)


def _question(config: HaystackTaskConfig, asked_keys: list[str]) -> str:
    if config.record_format == "compact":
        return compact_record_prefix(asked_keys[0])
    single_fmt = " Reply with a JSON string." if config.answer_format == "json" else ""
    if config.variant == "kv_retrieval":
        return f"Question: What is the value of key {asked_keys[0]}?{single_fmt} Answer:"
    if config.variant == "multi_hop":
        return (
            f"Question: Start at key {asked_keys[0]} and follow the pointers from key to key. "
            f"What is the value at the end of the chain?{single_fmt} Answer:"
        )
    keys = ", ".join(asked_keys[:-1]) + f" and {asked_keys[-1]}"
    how = "as a JSON list of strings" if config.answer_format == "json" else "separated by commas"
    return f"Question: What are the values of keys {keys}? Give them in this order, {how}. Answer:"


def _header(config: HaystackTaskConfig) -> str:
    if config.variant == "multi_hop":
        return "The lines below hold key-value records and pointers from key to key, mixed with unrelated notes.\n"
    return "The lines below hold key-value records mixed with unrelated notes.\n"


class _Draft:
    """The texts of one example before tokenization."""

    def __init__(self, config: HaystackTaskConfig, rng: np.random.Generator):
        c = config
        key_space = len(c.key_alphabet) ** c.key_length
        num_needle_keys = c.num_needle_records
        num_distractors = min(c.num_distinct_distractors, key_space - num_needle_keys)
        keys = _draw_distinct_strings(
            rng, num_needle_keys + num_distractors, c.key_alphabet, c.key_length
        )
        needle_keys, distractor_keys = keys[:num_needle_keys], keys[num_needle_keys:]

        # Distinct needle values, so a multi-needle answer names each needle unambiguously.
        needle_values = _draw_distinct_strings(rng, c.num_needles, c.value_alphabet, c.value_length)
        distractor_values = _draw_strings(rng, num_distractors, c.value_alphabet, c.value_length)

        # Needle records, in chain order for multi_hop.
        self.needles: list[dict] = []
        if c.variant == "multi_hop":
            for src, dst in itertools.pairwise(needle_keys):
                self.needles.append({"kind": "pointer", "key": src, "target": dst})
            self.needles.append(
                {"kind": "value", "key": needle_keys[-1], "value": needle_values[0]}
            )
            self.asked_keys = [needle_keys[0]]
        else:
            for key, value in zip(needle_keys, needle_values, strict=True):
                self.needles.append({"kind": "value", "key": key, "value": value})
            self.asked_keys = list(needle_keys)
        self.values = list(needle_values)

        # Distractors: in multi_hop a third of them are pointers to distractor keys that have a
        # value, so pointer lines are not themselves the tell of the needle chain.
        self.distractor_texts = []
        num_pointers = num_distractors // 3 if c.variant == "multi_hop" else 0
        num_valued = num_distractors - num_pointers
        for key, value in zip(distractor_keys[:num_valued], distractor_values, strict=False):
            self.distractor_texts.append(value_record(key, value, c.record_format))
        if num_pointers and num_valued:
            targets = rng.integers(num_valued, size=num_pointers)
            for key, t in zip(distractor_keys[num_valued:], targets.tolist(), strict=True):
                self.distractor_texts.append(pointer_record(key, distractor_keys[t]))

        self.needle_texts = [
            value_record(n["key"], n["value"], c.record_format)
            if n["kind"] == "value"
            else pointer_record(n["key"], n["target"])
            for n in self.needles
        ]
        self.header = _header(c) if c.include_header else None
        self.question = _question(c, self.asked_keys)
        self.answer = _format_answer(self.values, c.answer_format)
        # The response starts right after "Answer:", so the expected completion has the space.
        self.answer_completion = " " + self.answer


# --------------------------------------------------------------------------------------------
# Exact-length body


def _fill_exactly(
    rng: np.random.Generator,
    remainder: int,
    lengths_K: np.ndarray,
    prose_K: np.ndarray,
    distractor_K: np.ndarray,
    distractor_fraction: float,
) -> list[int] | None:
    """Pieces whose token lengths sum to exactly `remainder`, or None if no combination does.

    A reachability table over sums (coin change), then a random walk down it that picks the
    kind of each piece by `distractor_fraction`, falling back to the other kind when that kind
    has no piece of a usable length.
    """
    reach = np.zeros(remainder + 1, dtype=bool)
    reach[0] = True
    distinct = sorted(set(lengths_K[np.concatenate([prose_K, distractor_K])].tolist()))
    for r in range(1, remainder + 1):
        reach[r] = any(length <= r and reach[r - length] for length in distinct)
    if not reach[remainder]:
        return None
    chosen: list[int] = []
    r = remainder
    while r > 0:
        kinds = (
            (distractor_K, prose_K)
            if rng.random() < distractor_fraction
            else (prose_K, distractor_K)
        )
        for kind in kinds:
            lens = lengths_K[kind]
            ok = kind[(lens <= r) & reach[np.maximum(r - lens, 0)]]
            if ok.size:
                piece = int(ok[rng.integers(ok.size)])
                chosen.append(piece)
                r -= int(lengths_K[piece])
                break
        else:
            raise AssertionError("reachability table said the remainder was fillable")
    return chosen


def _draw_body(
    rng: np.random.Generator,
    budget: int,
    lengths_K: np.ndarray,
    prose_K: np.ndarray,
    distractor_K: np.ndarray,
    distractor_fraction: float,
) -> np.ndarray:
    """[N] int32 piece indices whose token lengths sum to exactly `budget`."""
    max_len = int(lengths_K.max())
    # Leave a remainder well above the largest piece, where every sum is reachable whenever
    # the pieces' lengths have gcd 1 (the Frobenius number of such sets is below max_len**2,
    # but short prose lines of 2-4 tokens make it tiny in practice).
    slack = max(4 * max_len, 64)
    frac = distractor_fraction if distractor_K.size else 0.0
    mean_len = (1 - frac) * lengths_K[prose_K].mean() + (
        frac * lengths_K[distractor_K].mean() if distractor_K.size else 0.0
    )
    greedy = np.zeros(0, dtype=np.int32)
    total = 0
    target = budget - slack
    while total < target:
        n = int((target - total) / mean_len * 1.05) + 16
        is_distractor = rng.random(n) < frac
        prose_pick = prose_K[rng.integers(prose_K.size, size=n)]
        distractor_pick = (
            distractor_K[rng.integers(distractor_K.size, size=n)]
            if distractor_K.size
            else prose_pick
        )
        block = np.where(is_distractor, distractor_pick, prose_pick).astype(np.int32)
        ends = total + np.cumsum(lengths_K[block])
        keep = int(np.searchsorted(ends, target, side="right"))
        greedy = np.concatenate([greedy, block[:keep]])
        total = int(ends[keep - 1]) if keep else total
        if keep < n:
            break
    while True:
        tail = _fill_exactly(rng, budget - total, lengths_K, prose_K, distractor_K, frac)
        if tail is not None:
            return np.concatenate([greedy, np.asarray(tail, dtype=np.int32)])
        if greedy.size == 0:
            raise ValueError(
                f"no combination of filler lines has exactly {budget} tokens; change "
                "num_prompt_tokens by a few tokens"
            )
        # A larger remainder is reachable more often: give back the last greedy piece.
        total -= int(lengths_K[greedy[-1]])
        greedy = greedy[:-1]


def _gather(flat_T: np.ndarray, starts_K: np.ndarray, lengths_K: np.ndarray, seq_N: np.ndarray):
    """[P] int32: the concatenation of the pieces' ids, gathered block by block so the index
    temporaries stay a few MB whatever P is."""
    lens_N = lengths_K[seq_N]
    out_starts_N = np.concatenate([[0], np.cumsum(lens_N)])
    out = np.empty(int(out_starts_N[-1]), dtype=np.int32)
    block = 1 << 16
    for b in range(0, seq_N.size, block):
        s = slice(b, min(b + block, seq_N.size))
        lo, hi = int(out_starts_N[s.start]), int(out_starts_N[s.stop])
        shift = np.repeat(starts_K[seq_N[s]] - out_starts_N[s.start : s.stop], lens_N[s])
        out[lo:hi] = flat_T[np.arange(lo, hi, dtype=np.int64) + shift]
    return out, out_starts_N


def _check_boundaries(tokenizer, texts, ids_K, seq_N, rng, must_check: list[int]) -> None:
    """Encode pairs of adjacent pieces and compare with the concatenation of their ids."""
    positions = set(must_check)
    if seq_N.size > 1:
        positions.update(rng.integers(seq_N.size - 1, size=min(256, seq_N.size - 1)).tolist())
    pairs = [(int(seq_N[i]), int(seq_N[i + 1])) for i in sorted(positions) if i + 1 < seq_N.size]
    encoded = encode_texts(tokenizer, [texts[a] + texts[b] for a, b in pairs])
    for (a, b), joint in zip(pairs, encoded, strict=True):
        if joint != ids_K[a] + ids_K[b]:
            raise ValueError(
                f"the tokenizer merges tokens across the line boundary {texts[a]!r} + {texts[b]!r} "
                f"(jointly {len(joint)} tokens, separately {len(ids_K[a]) + len(ids_K[b])}), so "
                "the haystack ids would not equal encode(prompt_text()). Use a byte-level BPE "
                "tokenizer without add_prefix_space, or set check_tokenization=False to accept "
                "that difference."
            )


@register_task("haystack")
def generate_haystack_task(config: HaystackTaskConfig, tokenizer) -> TaskExample:
    """One haystack prompt of exactly `config.num_prompt_tokens` ids, with its answer.

    `tokenizer`: a `tokenizers.Tokenizer`, a transformers tokenizer, or any object whose
    `encode(text)` gives token ids; only a few hundred short lines are ever encoded.
    """
    rng = np.random.default_rng(config.seed)
    draft = _Draft(config, rng)
    # Drawn before anything that depends on token lengths: keys, values and needle depths are
    # the same for every tokenizer; only the filler layout differs.
    n_records = config.num_needle_records
    depths = (
        np.asarray(config.needle_depths, dtype=np.float64)
        if config.needle_depths is not None
        else rng.random(n_records)
    )

    # Piece table: prose [0, F), distractors [F, F+D), then header, needles, question.
    texts: list[str] = list(FILLER_LINES) + draft.distractor_texts
    prose_K = np.arange(len(FILLER_LINES), dtype=np.int32)
    distractor_K = np.arange(len(FILLER_LINES), len(texts), dtype=np.int32)
    header_k = None
    if draft.header is not None:
        header_k = len(texts)
        texts.append(draft.header)
    needle_k0 = len(texts)
    texts.extend(draft.needle_texts)
    question_k = len(texts)
    texts.append(draft.question)

    ids_K = encode_texts(tokenizer, [*texts, draft.answer_completion])
    answer_ids = np.asarray(ids_K.pop(), dtype=np.int32)
    lengths_K = np.asarray([len(ids) for ids in ids_K], dtype=np.int64)
    if (lengths_K == 0).any():
        raise ValueError("the tokenizer returned no ids for a non-empty line; check the tokenizer")
    fixed = int(lengths_K[needle_k0:].sum()) + (
        int(lengths_K[header_k]) if header_k is not None else 0
    )
    budget = config.num_prompt_tokens - fixed
    if budget < 0:
        raise ValueError(
            f"header, needles and question alone take {fixed} tokens: set num_prompt_tokens "
            f">= {fixed} (or drop the header, or ask fewer needles)"
        )
    body_N = _draw_body(rng, budget, lengths_K, prose_K, distractor_K, config.distractor_fraction)

    # Needles go to the body boundary nearest their depth (in body tokens).
    body_ends = np.concatenate([[0], np.cumsum(lengths_K[body_N])])
    targets = depths * budget
    right = np.clip(np.searchsorted(body_ends, targets), 0, body_N.size)
    left = np.maximum(right - 1, 0)
    slots = np.where(
        np.abs(body_ends[left] - targets) <= np.abs(body_ends[right] - targets), left, right
    )
    order = np.argsort(slots, kind="stable")  # needles at one slot keep chain order
    seq_N = np.insert(body_N, slots[order], (needle_k0 + order).astype(np.int32))
    needle_pos = np.empty(n_records, dtype=np.int64)
    needle_pos[order] = slots[order] + np.arange(n_records)
    prefix = [header_k] if header_k is not None else []
    seq_N = np.concatenate([np.asarray(prefix, np.int32), seq_N, [np.int32(question_k)]]).astype(
        np.int32
    )
    needle_pos += len(prefix)

    flat_T = np.concatenate([np.asarray(ids, dtype=np.int32) for ids in ids_K])
    starts_K = np.concatenate([[0], np.cumsum(lengths_K)[:-1]])
    prompt_ids, starts_N = _gather(flat_T, starts_K, lengths_K, seq_N)
    assert prompt_ids.shape[0] == config.num_prompt_tokens, (prompt_ids.shape, config)

    if config.check_tokenization:
        around = [p + d for p in needle_pos.tolist() for d in (-1, 0)]
        around += [0, seq_N.size - 2]
        _check_boundaries(tokenizer, texts, ids_K, seq_N, rng, [p for p in around if p >= 0])

    needles = []
    for i, record in enumerate(draft.needles):
        pos = int(needle_pos[i])
        start = int(starts_N[pos])
        needles.append(
            record
            | {
                "text": draft.needle_texts[i],
                "token_start": start,
                "num_tokens": int(lengths_K[needle_k0 + i]),
                "depth": start / config.num_prompt_tokens,
            }
        )
    metadata = {
        "task": "haystack",
        "variant": config.variant,
        "seed": config.seed,
        "num_prompt_tokens": config.num_prompt_tokens,
        "asked_keys": draft.asked_keys,
        "values": draft.values,
        "answer": draft.answer,
        "answer_completion": draft.answer_completion,
        "answer_format": config.answer_format,
        "value_alphabet": config.value_alphabet,
        "value_length": config.value_length,
        "needles": needles,
        "question": draft.question,
        "question_token_start": int(starts_N[-2]),
        "config": config.model_dump(mode="json"),
    }
    return TaskExample(
        prompt_ids=prompt_ids,
        answer=draft.answer,
        answer_ids=answer_ids,
        metadata=metadata,
        piece_texts=tuple(texts),
        piece_sequence=seq_N,
    )
