"""Optimizer state written by N ranks (each its dim-0 rows) reads back at any world size.

Legend: a [7, 3] moment and a [1] bias moment (fewer rows than ranks: some rank files hold no
rows), written by 2 or 3 ranks in `torch.chunk`'s layout (FSDP2's shards).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from longstraw.distributed.gradient_slices import SliceLayout
from longstraw.storage.checkpoints import (
    load_optimizer_rows,
    optimizer_parts,
    save_optimizer_part,
)

WHOLE = {
    "exp_avg/w": torch.arange(21, dtype=torch.float32).reshape(7, 3),
    "exp_avg/b": torch.tensor([5.0]),
    "step/w": torch.tensor([3.0]),
    "step/b": torch.tensor([3.0]),
    "meta/step_count": torch.tensor([3], dtype=torch.int64),
}


def _rows(dim0: int, rank: int, world: int) -> tuple[int, int]:
    (piece,) = SliceLayout(rank, world, 1).pieces(dim0)
    return piece


def _write(path, world: int) -> None:
    for rank in range(world):
        part = {
            key: value
            if key.startswith(("step/", "meta/"))
            else value[slice(*_rows(value.shape[0], rank, world))].contiguous()
            for key, value in WHOLE.items()
        }
        save_optimizer_part(path, part, rank, world)


@pytest.mark.parametrize("saved_by", [1, 2, 3])
@pytest.mark.parametrize("read_by", [1, 2, 3])
def test_rows_written_by_n_ranks_read_back_by_m_ranks(tmp_path, saved_by, read_by):
    _write(tmp_path, saved_by)
    assert len(optimizer_parts(tmp_path)) == saved_by
    for rank in range(read_by):
        got = load_optimizer_rows(tmp_path, lambda key, dim0, rank=rank: _rows(dim0, rank, read_by))
        assert got.keys() == WHOLE.keys()
        for key, value in WHOLE.items():
            want = (
                value
                if key.startswith(("step/", "meta/"))
                else value[slice(*_rows(value.shape[0], rank, read_by))]
            )
            assert torch.equal(got[key], want), (key, rank)
    whole = load_optimizer_rows(tmp_path)
    assert all(torch.equal(whole[k], v) for k, v in WHOLE.items())


def test_a_missing_rank_file_is_named_not_read_as_a_smaller_state(tmp_path):
    _write(tmp_path, 3)
    (tmp_path / "optimizer-rank1-of-3.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no complete optimizer state"):
        load_optimizer_rows(tmp_path)


def test_single_process_file_is_one_part(tmp_path):
    save_file(WHOLE, str(tmp_path / "optimizer.safetensors"))
    assert [p.name for p in optimizer_parts(tmp_path)] == ["optimizer.safetensors"]
