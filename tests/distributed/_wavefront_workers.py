"""Functions the wavefront-prefill tests run on every rank (module level, like `_workers`)."""

from __future__ import annotations

import os

import torch
from _workers import _group

# Every per-rank tensor of a K/V or Gated DeltaNet state (None where the family has none).
STATE_FIELDS = ("keys", "values", "conv", "recurrent", "final_conv", "final_recurrent")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _wavefront_bytes(model, state) -> int:
    """Bytes this rank sends during `wavefront_prefill`: per full-attention layer its shards'
    queries to every earlier rank (H·R·D·4 each) and its partials (H·R·(V+1)·4) for every shard
    of every later rank; per Gated DeltaNet layer its end state to the next rank. Nothing grows
    with the positions a rank holds: no K/V moves."""
    from longstraw.distributed.sharded_state import rank_shard_ranges

    spec, rank, world = state.spec, state.rank, state.world_size
    heads = model.config.get_text_config().num_attention_heads
    total = 0
    if spec.full_attention is not None:
        fa = spec.full_attention
        ranges = rank_shard_ranges(state.num_shards, world)

        def tokens(r: int) -> int:
            return state.bounds[ranges[r][-1]][1] - state.bounds[ranges[r][0]][0]

        queries = rank * heads * tokens(rank) * fa.head_dim * 4
        partials = sum(
            heads * tokens(r) * (fa.value_head_dim + 1) * 4 for r in range(rank + 1, world)
        )
        total += len(fa.layer_indices) * (queries + partials)
    if spec.linear_attention is not None and rank + 1 < world:
        total += sum(t[:, -1].numel() * t.element_size() for t in (state.conv, state.recurrent))
    return total


def wavefront_against_sequential(
    rank: int, world: int, checkpoint: str, prompt_len: int, shard_tokens: int, gradients: bool
):
    """The wavefront state against `sharded_prefill`'s, field by field; optionally the exact-mode
    group gradients (replay + `sharded_sweep`, which re-checks every shard bitwise) from both."""
    from longstraw.distributed.cross_rank_attention import COMM
    from longstraw.distributed.sharded_group import sharded_group_gradients
    from longstraw.distributed.sharded_prefill import sharded_prefill
    from longstraw.distributed.wavefront_prefill import wavefront_prefill
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.schemas.grpo import GRPOConfig

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    prompt, responses, advantages = _group(model.config.get_text_config().vocab_size, prompt_len)
    before = COMM.bytes_sent
    sequential = sharded_prefill(model, prompt, shard_tokens=shard_tokens)
    sequential_bytes = COMM.bytes_sent - before
    before = COMM.bytes_sent
    wavefront = wavefront_prefill(model, prompt, shard_tokens=shard_tokens)
    out: dict = {
        "shards": list(wavefront.shards),
        "sequential_bytes": sequential_bytes,
        "wavefront_bytes": COMM.bytes_sent - before,
        "fields": {},
    }
    out["wavefront_bytes_formula"] = _wavefront_bytes(model, wavefront)
    for name in STATE_FIELDS:
        want, got = getattr(sequential, name), getattr(wavefront, name)
        if want is None:
            assert got is None
            continue
        out["fields"][name] = {
            "bitwise": torch.equal(got, want),
            "max_diff": _max_diff(got, want),
            "shape": tuple(got.shape),
        }
    if gradients:
        config = GRPOConfig(beta=0.0)
        got, got_logps = sharded_group_gradients(
            model, wavefront, responses, advantages, config, prompt_grad="exact"
        )
        want, want_logps = sharded_group_gradients(
            model, sequential, responses, advantages, config, prompt_grad="exact"
        )
        out["grads_bitwise"] = set(got.grads) == set(want.grads) and all(
            torch.equal(got.grads[n], g) for n, g in want.grads.items()
        )
        out["grads_max_diff"] = max(_max_diff(got.grads[n], g) for n, g in want.grads.items())
        out["grads_nonzero"] = sum(int(g.abs().sum() > 0) for g in want.grads.values())
        out["logps_bitwise"] = all(
            torch.equal(g, w) for g, w in zip(got_logps, want_logps, strict=True)
        )
    return out


def die_during_wavefront(rank: int, world: int, checkpoint: str, dying_rank: int, how: str):
    """`dying_rank` exits hard (`how="exit"`) or raises (`how="raise"`) inside decoder layer 1 of
    its first shard, while the other ranks are mid-wavefront."""
    from longstraw.distributed.wavefront_prefill import wavefront_prefill
    from longstraw.models.adapters import decoder_of
    from longstraw.models.checkpoint import load_checkpoint

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    prompt, _, _ = _group(model.config.get_text_config().vocab_size, 60)

    def fail(module, args):
        if how == "exit":
            os._exit(17)
        raise ValueError(f"injected failure on rank {rank}")

    if rank == dying_rank:
        decoder_of(model).layers[1].register_forward_pre_hook(fail)
    wavefront_prefill(model, prompt, shard_tokens=7)
    return "finished"
