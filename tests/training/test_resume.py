"""Resume: a run checkpointed after 2 steps and resumed for step 3 is the uninterrupted run, and
an interrupted prefill is continued from its committed shards, not recomputed.

Legend: P prompt tokens, T = P - 1 state tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from longstraw.engine import state_tiers
from longstraw.engine.prefill import prefill
from longstraw.models.checkpoint import load_checkpoint, read_checkpoint_metadata
from longstraw.schemas.storage import StateKey, StorageConfig
from longstraw.storage.checkpoints import latest_checkpoint
from longstraw.training.loop import read_metrics, train
from longstraw.training.persisted_prefill import PrefillSession, persisted_prefill
from longstraw.training.prompts import prompt_digest
from tests.training.helpers import algorithm_fields, run_config

SEED = 42
PICKLE_MAGIC = b"\x80"  # every pickle protocol >= 2 stream starts with PROTO (0x80)


@pytest.fixture(scope="module")
def interrupted_and_uninterrupted(tmp_path_factory, checkpoint_dir):
    """(uninterrupted 3-step context, resumed context) of the same run config."""
    root = tmp_path_factory.mktemp("resume")
    ckpt = checkpoint_dir("qwen3_5")
    whole = train(run_config(root, ckpt, run_id="whole", num_steps=3))
    train(run_config(root, ckpt, run_id="split", num_steps=2))
    resumed = train(run_config(root, ckpt, run_id="split", num_steps=3), resume=True)
    return whole, resumed


def test_resumed_step_equals_uninterrupted_step(interrupted_and_uninterrupted):
    whole, resumed = interrupted_and_uninterrupted
    assert resumed.step == whole.step == 3
    assert resumed.policy_version == whole.policy_version == 3
    # The resumed process ran only step 3 (the metrics file holds the earlier ones).
    assert [algorithm_fields(m) for m in resumed.history] == [
        algorithm_fields(m) for m in whole.history[-1:]
    ]
    assert resumed.history[-1].loss == whole.history[-1].loss
    assert resumed.history[-1].reward_mean == whole.history[-1].reward_mean
    # Some step of the run learned something, so equality is not trivially zero == zero.
    assert any(m.grad_norm > 0 for m in whole.history)


def test_resumed_run_ends_with_the_same_weights(interrupted_and_uninterrupted):
    whole, resumed = interrupted_and_uninterrupted
    assert resumed.checkpoint_digest == whole.checkpoint_digest
    whole_weights = load_checkpoint(latest_checkpoint(whole.config.storage, "whole"))[0]
    resumed_weights = load_checkpoint(latest_checkpoint(resumed.config.storage, "split"))[0]
    for (name, a), (_, b) in zip(
        whole_weights.named_parameters(), resumed_weights.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_metrics_file_holds_every_step_once(interrupted_and_uninterrupted):
    whole, resumed = interrupted_and_uninterrupted
    assert [m.step for m in read_metrics(resumed.run_path)] == [0, 1, 2]
    assert [algorithm_fields(m) for m in read_metrics(resumed.run_path)] == [
        algorithm_fields(m) for m in read_metrics(whole.run_path)
    ]


def test_checkpoint_is_a_hugging_face_directory_without_pickle(interrupted_and_uninterrupted):
    _, resumed = interrupted_and_uninterrupted
    path = latest_checkpoint(resumed.config.storage, resumed.config.run_id)
    assert path is not None and path.name == "v000003"
    names = sorted(p.name for p in path.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "optimizer.safetensors"} <= set(
        names
    )
    assert {"trainer_state.json", "longstraw.json"} <= set(names)
    # No RNG state: rollouts draw from a generator seeded by (seed, step, prompt).
    assert "rng.safetensors" not in names
    for file in path.iterdir():
        assert file.suffix in (".json", ".safetensors", ".jinja"), file.name
        assert not file.read_bytes().startswith(PICKLE_MAGIC), file.name
    for file in path.glob("*.json"):
        json.loads(file.read_text())  # every JSON file parses
    for file in path.glob("*.safetensors"):
        assert load_file(str(file))  # every safetensors file loads (and holds tensors)
    model = AutoModelForCausalLM.from_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(path))
    for (name, a), (_, b) in zip(
        model.named_parameters(), resumed.context().model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    meta = read_checkpoint_metadata(path)
    assert (meta.policy_version, meta.weights_digest) == (3, resumed.checkpoint_digest)


def test_resume_without_a_checkpoint_says_what_to_do(tmp_path, checkpoint_dir):
    config = run_config(tmp_path, checkpoint_dir("qwen3_5"), run_id="never-ran")
    with pytest.raises(ValueError, match=r"has never started.*start it without --resume"):
        train(config, resume=True)


# --- persisted prefill ---------------------------------------------------------------------------


def _storage(root) -> StorageConfig:
    return StorageConfig(root_uri=str(root), persist_mode="synchronous")


def test_interrupted_prefill_resumes_from_its_committed_shards(tmp_path, checkpoint_dir):
    """A session that computed 2 of 4 shards is dropped; a new one reads those 2 back, computes
    the other 2, and gives the state an uninterrupted prefill gives, bitwise."""
    path = checkpoint_dir("qwen3_5")
    model, _, meta = load_checkpoint(path)
    gen = torch.Generator().manual_seed(SEED)
    prompt_P = torch.randint(0, model.config.vocab_size, (63,), generator=gen)
    shard_tokens = 17  # T = 62: shards of 17, 17, 17, 11
    storage = _storage(tmp_path)
    key = StateKey.policy("resume", 0, meta.weights_digest, prompt_digest(prompt_P))

    first = PrefillSession(model, prompt_P, shard_tokens=shard_tokens, storage=storage, key=key)
    assert first.num_shards == 4
    first.ensure_shard(1)
    assert (first.shards_computed, first.shards_reused) == (2, 0)
    first.close()  # the process "crashes": no commit

    second = PrefillSession(model, prompt_P, shard_tokens=shard_tokens, storage=storage, key=key)
    assert not second.reused_committed
    state, outcome = second.finish()
    assert (outcome.shards_reused, outcome.shards_computed) == (2, 2)
    assert outcome.ref is not None

    expected = prefill(model, prompt_P, shard_tokens=shard_tokens)
    for name, tensor in expected.tensors().items():
        assert torch.equal(state.tensors()[name], tensor), name

    # Once committed, the whole state is reused: nothing is computed.
    third_state, third = persisted_prefill(
        model, prompt_P, shard_tokens=shard_tokens, storage=storage, key=key
    )
    assert third.reused_committed and third.shards_computed == 0
    for name, tensor in expected.tensors().items():
        assert torch.equal(third_state.tensors()[name], tensor), name


def test_a_budgeted_prefill_never_holds_the_state_and_resumes_from_storage(
    tmp_path, checkpoint_dir, monkeypatch
):
    """Under a budget of 0 the session's state is tiered from the start: each shard's rows go
    straight to a scratch file, an interrupted prefill resumes from its recorded shards, and a
    committed state streams from its Zarr chunks; every stored row is the resident prefill's
    and branch log-probs replay the same bits."""
    from longstraw.engine import attention
    from longstraw.engine.replay import branch_logprobs
    from longstraw.engine.state_tiers import StateBudget

    monkeypatch.setattr(attention, "PREFIX_CHUNK_TOKENS", 8)  # 62 positions: 8 chunks
    path = checkpoint_dir("qwen3_5")
    model, _, meta = load_checkpoint(path)
    gen = torch.Generator().manual_seed(SEED)
    prompt_P = torch.randint(0, model.config.vocab_size, (63,), generator=gen)
    response = torch.randint(0, model.config.vocab_size, (5,), generator=gen)
    storage = _storage(tmp_path / "root")
    key = StateKey.policy("budget", 0, meta.weights_digest, prompt_digest(prompt_P))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    budget = StateBudget(0, "disk", str(scratch), exact=True)
    expected = prefill(model, prompt_P, shard_tokens=17)
    want = branch_logprobs(model, expected, response)

    def session():
        return PrefillSession(
            model, prompt_P, shard_tokens=17, storage=storage, key=key, budget=budget
        )

    first = session()
    first.ensure_shard(1)
    first.discard()  # the process "crashes": no commit, its scratch file gone
    assert not list(scratch.iterdir())
    second = session()
    state, outcome = second.finish()
    assert (outcome.shards_reused, outcome.shards_computed) == (2, 2)
    assert state.tiers is not None and isinstance(state.keys, state_tiers.TieredArray)
    for name, tensor in expected.tensors().items():
        stored = state.tensors()[name]
        rows = stored if isinstance(stored, torch.Tensor) else torch.stack(
            [stored.read(slot, 0, stored.shape[1]) for slot in range(stored.shape[0])]
        )  # fmt: skip
        assert torch.equal(rows, tensor), name
    assert torch.equal(branch_logprobs(model, state, response), want)
    store = state.tiers.store
    assert 0 < store.peak_resident_bytes <= 2 * store.chunk_unit_bytes
    second.discard()
    # Committed: a new session streams it from storage (nothing computed, nothing loaded whole).
    third = session()
    state, outcome = third.finish()
    assert outcome.reused_committed and outcome.shards_computed == 0
    assert state.tiers is not None
    assert torch.equal(branch_logprobs(model, state, response), want)
    third.discard()
    assert not list(scratch.iterdir())


def test_persist_off_computes_every_shard(tmp_path, checkpoint_dir):
    model, _, meta = load_checkpoint(checkpoint_dir("llama"))
    prompt_P = torch.arange(40) % model.config.vocab_size
    storage = StorageConfig(root_uri=str(tmp_path), persist_mode="off")
    key = StateKey.policy("off", 0, meta.weights_digest, prompt_digest(prompt_P))
    for _ in range(2):
        _, outcome = persisted_prefill(model, prompt_P, shard_tokens=13, storage=storage, key=key)
        assert (outcome.shards_computed, outcome.shards_reused, outcome.ref) == (3, 0, None)
    assert not any(tmp_path.iterdir())
