"""A run killed inside the exact reverse sweep resumes inside it: `--resume` takes the latest
sweep checkpoint, recomputes only the shards after it, and ends on the uninterrupted run's
weights, optimizer state and metrics, bitwise.

In one process, the kill is an exception raised at a chosen point of group 0's sweep (the test
hook: the sweep's progress callback, or the checkpoint's commit), and `train(resume=True)` in a
process that forgot everything it held is the resumed run. One run is killed four times, each
resume at another point: before the first checkpoint, while a checkpoint is written (its parts
written, no marker), between two checkpoints, and after the last. Killed with SIGKILL, on ranks
and replicas: tests/training/test_sweep_kill.py.

A LoRA run's checkpoint holds the adapters' gradient and nothing else, and its key names the
seed the adapters were drawn from; killed between two checkpoints it resumes bitwise too.

Legend: the tiny qwen3_5 hybrid, a 64-token prompt (63 state tokens in 5 shards of 13), exact
prompt gradient, G = 3, two groups, one step; a sweep checkpoint after every swept shard.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import longstraw.training.stages as stages_module
from longstraw.schemas.run import RunConfig
from longstraw.storage.checkpoints import latest_checkpoint
from longstraw.storage.gc import list_sweeps
from longstraw.storage.sweep_checkpoints import SweepCheckpointStore
from longstraw.training import held
from longstraw.training.loop import train
from longstraw.training.metrics import read_metrics
from longstraw.training.sweep_checkpoints import sweep_progress
from tests.training.helpers import MACHINE_FIELDS, run_config

pytestmark = pytest.mark.slow

NUM_SHARDS = 5
WORK_COUNTS = {"shards_computed", "shards_reused", "sweep_shards_computed", "sweep_shards_resumed"}
"""What a resumed step counts differently by design: the work it redid and the work it took."""


class Killed(Exception):
    """The test's kill, in-process."""


def _config(root, checkpoint, run_id: str, **engine):
    return run_config(
        root,
        checkpoint,
        run_id=run_id,
        num_steps=1,
        grpo={"num_generations": 3},
        data={"rewards": ["tests.training.helpers:checksum_reward"]},
        engine={"shard_tokens": 13, "sweep_checkpoint_every": 1, **engine},
        persist_mode="synchronous",
    )


def _final(config) -> tuple[dict[str, torch.Tensor], list]:
    """(every tensor of the final checkpoint, the metrics rows) of a finished run."""
    path = latest_checkpoint(config.storage, config.run_id)
    tensors = {
        f"{f.name}:{name}": t
        for f in sorted(path.glob("*.safetensors"))
        for name, t in load_file(f).items()
    }
    return tensors, read_metrics(path.parents[1])


def _same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
        assert torch.equal(got[name].view(bits), tensor.view(bits)), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, checkpoint_dir):
    root = tmp_path_factory.mktemp("sweep-resume")
    config = _config(root, checkpoint_dir("qwen3_5"), "whole")
    outcome = train(config)
    (metrics,) = outcome.history
    assert metrics.grad_norm > 0, "no gradient: bitwise equality would be vacuous"
    assert (metrics.sweep_shards_computed, metrics.sweep_shards_resumed) == (2 * NUM_SHARDS, 0)
    return _final(config)


def same_metrics(got: list, want: list, skip: frozenset = frozenset()) -> None:
    """Every metrics row of a resumed run equals the uninterrupted run's, but for the machine's
    figures, the work counts a resume changes by design, and `skip`."""
    leave_out = MACHINE_FIELDS | WORK_COUNTS | skip
    for got_row, want_row in zip(got, want, strict=True):
        got_fields, want_fields = (
            got_row.model_dump(exclude=leave_out),
            want_row.model_dump(exclude=leave_out),
        )
        differ = {k: (got_fields[k], v) for k, v in want_fields.items() if got_fields[k] != v}
        assert not differ, differ


def _killing(monkeypatch, at: str, swept: int) -> None:
    """Raise `Killed` in group 0's backward: at "progress" once `swept` shards are swept (after
    the checkpoint due at the previous one), at "commit" when checkpoint `swept`'s marker would
    be created (every part written)."""
    monkeypatch.undo()
    if at == "progress":

        def killing_progress(group: int):
            told = sweep_progress(group)

            def tell(done: int, total: int, resumed: int) -> None:
                if group == 0 and done == swept:
                    raise Killed(f"after {done} shards")
                told(done, total, resumed)

            return tell

        monkeypatch.setattr(stages_module, "sweep_progress", killing_progress)
    else:
        commit = SweepCheckpointStore.commit

        def killing_commit(self, attempt_id, at_swept, parts, record):
            if self.key.group == 0 and at_swept == swept:
                raise Killed(f"writing checkpoint {at_swept}")
            return commit(self, attempt_id, at_swept, parts, record)

        monkeypatch.setattr(SweepCheckpointStore, "commit", killing_commit)


KILLS = [
    # (where, at, swept: the kill; the latest checkpoint the next run resumes from)
    ("before the first checkpoint", "progress", 1, None),
    ("while checkpoint 3 is written", "commit", 3, 2),
    ("between checkpoints 3 and 4", "progress", 4, 3),
    ("after the last checkpoint", "progress", 5, 4),
]


def test_a_sweep_killed_anywhere_resumes_inside_itself_and_ends_on_the_uninterrupted_run(
    tmp_path, checkpoint_dir, uninterrupted, monkeypatch
):
    want, want_metrics = uninterrupted
    config = _config(tmp_path, checkpoint_dir("qwen3_5"), "killed")
    resume = False
    for where, at, swept, latest in KILLS:
        _killing(monkeypatch, at, swept)
        with pytest.raises(Killed):
            train(config, resume=resume)
        held.forget_run(config.run_id)  # a fresh process holds nothing
        sweeps = list_sweeps(config.storage.root_uri)
        assert [s.committed for s in sweeps] in ([], [[]], [[latest]]), where
        assert (sweeps[0].committed if sweeps else []) == ([latest] if latest else []), where
        resume = True
    monkeypatch.undo()
    outcome = train(config, resume=True)
    (metrics,) = outcome.history
    # The last resume swept only the shard after the last checkpoint of group 0.
    assert (metrics.sweep_shards_computed, metrics.sweep_shards_resumed) == (
        2 * NUM_SHARDS - 4,
        4,
    )
    # Both prompt states were committed before the first kill: read back.
    assert (metrics.shards_computed, metrics.shards_reused) == (0, 2 * NUM_SHARDS)
    got, got_metrics = _final(config)
    _same_bits(got, want)
    same_metrics(got_metrics, want_metrics)
    # Its result recorded, the backward's sweep checkpoints are gone.
    assert list_sweeps(config.storage.root_uri) == []


LORA = {"r": 4, "lora_alpha": 8, "init_lora_weights": False}
"""Rank-4 adapters on every linear layer, B random too: every A and B has a gradient."""


def _lora_config(root, checkpoint, run_id: str) -> RunConfig:
    raw = _config(root, checkpoint, run_id).model_dump(mode="json")
    raw["model"]["lora"] = LORA
    return RunConfig.model_validate(raw)


def test_a_lora_run_killed_inside_the_sweep_resumes_on_its_adapters_bitwise(
    tmp_path, checkpoint_dir, monkeypatch
):
    checkpoint = checkpoint_dir("qwen3_5")
    whole = _lora_config(tmp_path, checkpoint, "lora-whole")
    outcome = train(whole)
    (want_metrics,) = outcome.history
    assert want_metrics.grad_norm > 0, "no gradient: bitwise equality would be vacuous"
    adapters = {n for n, p in outcome.context().model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    want, want_rows = _final(whole)

    config = _lora_config(tmp_path, checkpoint, "lora-killed")
    committed = []
    commit = SweepCheckpointStore.commit

    def recording_commit(self, *args, **kwargs):
        committed.append(commit(self, *args, **kwargs))
        return committed[-1]

    _killing(monkeypatch, "progress", 4)  # between checkpoints 3 and 4 of group 0
    monkeypatch.setattr(SweepCheckpointStore, "commit", recording_commit)
    with pytest.raises(Killed):
        train(config)
    monkeypatch.undo()
    held.forget_run(config.run_id)
    manifest = committed[-1]
    assert (manifest.key.group, manifest.swept) == (0, 3)
    assert manifest.key.adapters == "drawn from train.seed 42"
    (part,) = manifest.parts
    grads = {e.name.removeprefix("grad/") for e in part.tensors if e.name.startswith("grad/")}
    assert grads == adapters, "the frozen base has no gradient to keep"
    assert [s.committed for s in list_sweeps(config.storage.root_uri)] == [[3]]

    (metrics,) = train(config, resume=True).history
    assert (metrics.sweep_shards_computed, metrics.sweep_shards_resumed) == (
        2 * NUM_SHARDS - 3,
        3,
    )
    got, got_rows = _final(config)
    _same_bits(got, want)
    same_metrics(got_rows, want_rows)
