"""A reverse sweep resumed from its checkpoint ends on the uninterrupted gradient, bitwise.

The engine's side of sweep checkpoints (`engine.sweep_checkpoint`): a sweep that fails after
shard k, with a checkpoint committed at some shard before, is run again from that checkpoint —
no replay, only the shards left — and gives the uninterrupted run's gradient and statistics bit
for bit, resident or tiered (the cotangent in a lower tier), for every family. The checkpoints
here live in memory (`MemoryCheckpoints`, a copy of each tensor); storage's own round trip is
tests/storage/test_sweep_checkpoints.py.

Legend: P = 100 prompt tokens in shards of 23 (5 shards, the last one short), G = 3.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import random_group, vocab_of

from longstraw.engine.group import group_gradient, group_inputs
from longstraw.engine.prefill import prefill
from longstraw.models.lora import with_lora
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig, LoraConfig

SHARD_TOKENS = 23
PROMPT = 100
PIECE = 37
"""Elements a checkpoint reads and writes at a time, as storage's chunks do: pieces that start
and end inside a position's row (and, tiered, across the tier's chunks)."""


class Interrupted(Exception):
    """Raised where the test stops a sweep (a kill, in-process)."""


class MemoryCheckpoints:
    """`SweepCheckpoints` in memory: copies of the tensors of every committed checkpoint."""

    def __init__(self, every: int, stop_after: int | None = None):
        self.every, self.stop_after = every, stop_after
        self.saved: dict[int, tuple[dict[str, torch.Tensor], dict]] = {}
        self.restored: list[int] = []

    def latest(self):
        if not self.saved:
            return None
        swept = max(self.saved)
        tensors, record = self.saved[swept]
        store = self

        class Found:
            def __init__(self):
                self.swept, self.record = swept, record

            def read_into(self, targets) -> bool:
                assert [t.name for t in targets] == list(tensors)
                for target in targets:
                    for start in range(0, target.numel, PIECE):
                        target.write(start, tensors[target.name][start : start + PIECE])
                store.restored.append(swept)
                return True

        return Found()

    def due(self, swept: int) -> bool:
        return swept % self.every == 0

    def on_sweep_shard(self, done: int, total: int, resumed: int) -> None:
        """The test's kill: once more than `stop_after` shards are swept."""
        if self.stop_after is not None and done > self.stop_after:
            raise Interrupted(done)

    def save(self, swept, tensors, record) -> None:
        copies = {
            t.name: torch.cat(
                [t.read(i, min(i + PIECE, t.numel)) for i in range(0, t.numel, PIECE)]
            )
            for t in tensors
        }
        self.saved[swept] = (copies, record)


def _group(model, engine: EngineConfig, prompt_ids, checkpoints=None, state=None):
    cfg = GRPOConfig(loss_type="dapo", beta=0.0)
    _, responses, advantages = random_group(PROMPT, (5, 9, 2), vocab_of(model))
    inputs = group_inputs(model, responses, advantages, cfg, prompt_grad="exact")
    state = state or prefill(model, prompt_ids, shard_tokens=SHARD_TOKENS)
    grads, stats = group_gradient(
        model, state, inputs, cfg, engine, checkpoints=checkpoints,
        on_sweep_shard=None if checkpoints is None else checkpoints.on_sweep_shard,
    )  # fmt: skip
    return {n: g.clone() for n, g in grads.grads.items()}, stats


def _same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name].view(torch.int32), tensor.view(torch.int32)), name


_ALGORITHM = ("loss", "branch_losses", "branch_logprobs", "kl", "clip_ratio_low", "num_tokens")


STOPS = {"after-the-last": (4, 2, 4), "between-two": (3, 2, 2), "before-the-first": (1, 2, None)}
"""Where a sweep of 5 shards with a checkpoint every 2 swept stops: (stopped when this many are
swept, the checkpoint cadence, the latest checkpoint before the stop)."""


@pytest.mark.parametrize(
    ("family", "budget", "stops"),
    [
        ("qwen3_5", None, ["between-two"]),
        # Two more interrupted and resumed sweeps (~25 s on 2 busy cores): slow.
        pytest.param(
            "qwen3_5", None, ["before-the-first", "after-the-last"], marks=pytest.mark.slow
        ),
        ("qwen3_5", 0, ["between-two"]),
        ("glm_moe_dsa", None, ["between-two"]),
    ],
    ids=["hybrid", "hybrid-first-and-last", "hybrid-tiered", "glm"],
)
def test_a_sweep_resumed_from_its_checkpoint_is_the_uninterrupted_sweep(
    tiny_model, family, budget, stops
):
    model = tiny_model(family)
    engine = EngineConfig(shard_tokens=SHARD_TOKENS, state_budget_bytes=budget)
    prompt_ids, _, _ = random_group(PROMPT, (1,), vocab_of(model))
    state = prefill(model, prompt_ids, shard_tokens=SHARD_TOKENS)
    num_shards = state.num_shards
    assert num_shards == 5
    want, want_stats = _group(model, engine, prompt_ids, state=state)
    assert want_stats.sweep_shards_computed == num_shards
    for stop in stops:
        stop_after, every, latest = STOPS[stop]
        checkpoints = MemoryCheckpoints(every, stop_after)
        with pytest.raises(Interrupted):
            _group(model, engine, prompt_ids, checkpoints, state)
        assert max(checkpoints.saved, default=None) == latest, stop
        checkpoints.stop_after = None
        got, stats = _group(model, engine, prompt_ids, checkpoints, state)
        _same_bits(got, want)
        for field in _ALGORITHM:
            assert getattr(stats, field) == getattr(want_stats, field), field
        resumed = latest or 0
        assert (stats.sweep_shards_computed, stats.sweep_shards_resumed) == (
            num_shards - resumed,
            resumed,
        )
        assert checkpoints.restored == ([latest] if latest else [])


def test_a_checkpoint_that_does_not_read_back_starts_the_sweep_over(tiny_model):
    """A restore that fails midway (a damaged chunk) leaves nothing of it behind: the buffers
    it wrote are zeroed and the backward replays and sweeps from the top."""
    model = tiny_model("qwen3_5")
    engine = EngineConfig(shard_tokens=SHARD_TOKENS)
    prompt_ids, _, _ = random_group(PROMPT, (1,), vocab_of(model))
    state = prefill(model, prompt_ids, shard_tokens=SHARD_TOKENS)
    want, _ = _group(model, engine, prompt_ids, state=state)
    checkpoints = MemoryCheckpoints(every=3, stop_after=3)
    with pytest.raises(Interrupted):
        _group(model, engine, prompt_ids, checkpoints, state)
    (swept,) = checkpoints.saved
    tensors, record = checkpoints.saved[swept]

    class Damaged:
        def __init__(self):
            self.swept, self.record = swept, record

        def read_into(self, targets) -> bool:
            for target in targets[: len(targets) // 2]:  # half written, then a bad chunk
                target.write(0, tensors[target.name] + 1.0)
            return False

    checkpoints.latest = Damaged
    checkpoints.stop_after = None
    got, stats = _group(model, engine, prompt_ids, checkpoints, state)
    _same_bits(got, want)
    assert (stats.sweep_shards_computed, stats.sweep_shards_resumed) == (state.num_shards, 0)


def test_a_lora_sweep_keeps_the_adapters_gradient_only_and_resumes_bitwise(load_tiny):
    """A LoRA policy (peft's model, rank-4 adapters on every linear layer, both factors random
    so every A and B has a gradient): the checkpoint's gradient is the adapters' and nothing
    else — the frozen base accumulates none — and the sweep resumed from it is the
    uninterrupted one, bit for bit."""
    settings = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = with_lora(load_tiny("qwen3_5"), settings, seed=7)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    engine = EngineConfig(shard_tokens=SHARD_TOKENS)
    prompt_ids, _, _ = random_group(PROMPT, (1,), vocab_of(model))
    state = prefill(model, prompt_ids, shard_tokens=SHARD_TOKENS)
    want, want_stats = _group(model, engine, prompt_ids, state=state)
    assert set(want) == adapters and all(g.abs().sum() > 0 for g in want.values())
    checkpoints = MemoryCheckpoints(every=2, stop_after=3)
    with pytest.raises(Interrupted):
        _group(model, engine, prompt_ids, checkpoints, state)
    (swept,) = checkpoints.saved
    tensors, _ = checkpoints.saved[swept]
    kept = {
        name.removeprefix("grad/"): t for name, t in tensors.items() if name.startswith("grad/")
    }
    assert set(kept) == adapters, "a checkpoint keeps the trainable parameters' gradient only"
    assert {n: t.numel() for n, t in kept.items()} == {n: g.numel() for n, g in want.items()}
    checkpoints.stop_after = None
    got, stats = _group(model, engine, prompt_ids, checkpoints, state)
    _same_bits(got, want)
    for field in _ALGORITHM:
        assert getattr(stats, field) == getattr(want_stats, field), field
    assert (stats.sweep_shards_computed, stats.sweep_shards_resumed) == (
        state.num_shards - swept,
        swept,
    )
