"""A real byte-level BPE tokenizer built locally with the `tokenizers` library (no download).

The tokenizer is trained on a deterministic synthetic corpus that covers what LongStraw's synthetic
tasks write (English filler words, `key = value` records, digits, punctuation), so a haystack
prompt encodes to fewer tokens than bytes: measured on 4001-token haystack prompts, 1.67
bytes/token at the tiny vocab (512) and 2.14 at the small vocab (2048). Byte-level BPE keeps
every string encodable: unknown text falls back to byte tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
# Chat-style turn markers, so users' chat templates have somewhere to go; unused by the synthetic tasks.
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")

# Words the synthetic haystack tasks are made of; the trainer sees them many times so they become
# single tokens. Anything else still encodes through byte fallback.
_CORPUS_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "and",
    "or",
    "is",
    "was",
    "are",
    "were",
    "be",
    "been",
    "that",
    "this",
    "it",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "key",
    "value",
    "record",
    "note",
    "file",
    "document",
    "line",
    "page",
    "section",
    "tool",
    "output",
    "result",
    "answer",
    "question",
    "what",
    "which",
    "who",
    "where",
    "when",
    "find",
    "look",
    "remember",
    "retrieve",
    "report",
    "memory",
    "context",
    "agent",
    "step",
    "observation",
    "decision",
    "previous",
    "next",
    "first",
    "last",
    "number",
    "code",
    "name",
    "id",
    "item",
    "entry",
    "list",
    "table",
    "city",
    "river",
    "mountain",
    "color",
    "animal",
    "planet",
    "metal",
    "fruit",
    "season",
    "music",
    "garden",
    "ocean",
    "forest",
    "red",
    "blue",
    "green",
    "yellow",
    "black",
    "white",
    "silver",
    "golden",
    "quiet",
    "bright",
    "ancient",
    "distant",
    "hidden",
]


# ChatML over the turn markers above. `{% generation %}` marks what the assistant produced (its
# text and the <|im_end|> that ends its turn), so `apply_chat_template(...,
# return_assistant_tokens_mask=True)` gives the loss mask of a trajectory
# (longstraw.data.trajectory); the role header of a turn is given, not sampled.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _training_corpus(seed: int, num_lines: int = 4000) -> list[str]:
    """Deterministic lines of filler prose and `key = value` records."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    lines = []
    for _ in range(num_lines):
        words = rng.choices(_CORPUS_WORDS, k=rng.randint(6, 16))
        key = "".join(rng.choices(alphabet, k=rng.randint(3, 8)))
        value = str(rng.randint(0, 999_999))
        lines.append(f"{' '.join(words).capitalize()}. The value of key {key} is {value}.")
        lines.append(f"{key} = {value}; {key.upper()}: {value}, [{value}] ({key})\n")
    return lines


def build_tokenizer(vocab_size: int = 512, seed: int = 0) -> Tokenizer:
    """Train a byte-level BPE `tokenizers.Tokenizer` with `vocab_size` entries on the local corpus."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (256 bytes + special tokens); "
            f"got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(seed), trainer=trainer)
    return tokenizer


def build_hf_tokenizer(vocab_size: int = 512, seed: int = 0) -> PreTrainedTokenizerFast:
    """The same tokenizer wrapped as a transformers fast tokenizer (what `AutoTokenizer` returns),
    with a ChatML chat template (`CHAT_TEMPLATE`)."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(vocab_size, seed),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (+ special tokens map) into `out_dir`."""
    tokenizer.save_pretrained(str(out_dir))
