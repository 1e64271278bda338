"""Functions the wavefront-prefill tests run on every rank (module level, like `_workers`)."""

from __future__ import annotations

import os

import torch
from _workers import _group, _set_index_topk

# Every per-rank tensor of a K/V, Gated DeltaNet or GLM-5 MLA state (None where the family has
# none).
STATE_FIELDS = (
    "keys", "values", "conv", "recurrent", "final_conv", "final_recurrent", "latent", "rope_key",
    "indexer_key",
)  # fmt: skip


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _wavefront_bytes(model, state) -> int:
    """Bytes this rank sends during `wavefront_prefill`: per full-attention layer its shards'
    queries to every earlier rank (H·R·D·4 each) and its partials (H·R·(V+1)·4) for every shard
    of every later rank; per Gated DeltaNet layer its end state to the next rank. Nothing grows
    with the positions a rank holds: no K/V moves."""
    from longstraw.engine.state import rank_shard_ranges

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
    if spec.mla is not None:
        total += _glm_wavefront_bytes(model, state)
    return total


def _glm_wavefront_bytes(model, state) -> int:
    """GLM-5 (H heads, R latent rank, E rope dim, K `index_topk`, Hi / Di indexer heads / dim):
    per MLA layer, every shard of S queries with positions before it sends each earlier rank its
    absorbed queries (H·S·(R+E)·4 B) and gets the partial (H·S·(R+1)·4 B); where it attends a
    DSA selection (start + S > K) the selection goes too (S·K·8 B), and on a layer with its own
    indexer, first its indexer queries (S·Hi·(Di+1)·4 B) for the local top-k candidates
    (S·K·2·8 B). Bytes this rank SENDS: its requests to earlier ranks, its answers to later ones."""
    from longstraw.engine.state import rank_shard_ranges

    mla, world, rank = state.spec.mla, state.world_size, state.rank
    heads = model.config.get_text_config().num_attention_heads
    rank_dim, rope = mla.kv_lora_rank, mla.rope_dim
    ranges = rank_shard_ranges(state.num_shards, world)
    config = model.config.get_text_config()
    topk, index_heads, index_dim = config.index_topk, config.index_n_heads, config.index_head_dim
    total = 0
    for r in range(1, world):
        if r != rank and r <= rank:
            continue
        # Rank r's shards, each with `rank` (requests) or one (answers to this rank) peers.
        peers = rank if r == rank else 1
        for shard in ranges[r]:
            start, end = state.bounds[shard]
            length = end - start
            for layer in mla.layer_indices:
                source = max((i for i in mla.indexer_layer_indices if i <= layer), default=None)
                sparse = source is not None and end > topk
                selects = sparse and source == layer
                if r == rank:
                    sent = heads * length * (rank_dim + rope) * 4
                    sent += length * topk * 8 if sparse else 0
                    sent += length * index_heads * (index_dim + 1) * 4 if selects else 0
                else:
                    sent = heads * length * (rank_dim + 1) * 4
                    sent += length * topk * 2 * 8 if selects else 0
                total += peers * sent
    return total


def wavefront_against_sequential(
    rank: int,
    world: int,
    checkpoint: str,
    prompt_len: int,
    shard_tokens: int,
    gradients: bool,
    attention_window: int | None = None,
    index_topk: int | None = None,
):
    """The wavefront state against the sequential schedule's, field by field; optionally the exact-mode
    group gradients (replay + the reverse sweep, which re-checks every shard bitwise) from both."""
    from _group_gradients import dense_group_gradients

    from longstraw.distributed.cross_rank_attention import COMM
    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.distributed.wavefront_prefill import wavefront_prefill
    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.schemas.grpo import GRPOConfig

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    if index_topk is not None:  # GLM-5: the DSA top-k (2**20: the dense regime)
        _set_index_topk(model, index_topk)
    prompt, responses, advantages = _group(model.config.get_text_config().vocab_size, prompt_len)
    before = COMM.bytes_sent
    sequential = prefill(model, prompt, shard_tokens=shard_tokens, exchange=CrossRankExchange())
    sequential_bytes = COMM.bytes_sent - before
    before = COMM.bytes_sent
    wavefront = wavefront_prefill(
        model, prompt, shard_tokens=shard_tokens, attention_window=attention_window
    )
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
        got, got_logps = dense_group_gradients(
            model, wavefront, responses, advantages, config, prompt_grad="exact"
        )
        want, want_logps = dense_group_gradients(
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


def persisted_prefill_dying_with(
    rank: int,
    world: int,
    checkpoint: str,
    root: str,
    schedule: str,
    prompt_len: int,
    shard_tokens: int,
    dying_rank: int,
    dying_after_shard: int,
):
    """`persisted_prefill(schedule=...)` on the ranks; `dying_rank` exits hard once
    `dying_after_shard` is recorded (synchronous writers), or with -1 inside decoder layer 1 of
    its first computed shard (mid-wavefront, before anything is recorded)."""
    from _workers import _persisted_setup

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.models.adapters import decoder_of
    from longstraw.training.persisted_prefill import persisted_prefill

    model, prompt, _, _, storage, key = _persisted_setup(
        checkpoint, root, prompt_len, "synchronous"
    )
    if rank == dying_rank and dying_after_shard < 0:
        decoder_of(model).layers[1].register_forward_pre_hook(lambda module, args: os._exit(17))

    def on_shard(state, shard):
        if rank == dying_rank and shard == dying_after_shard:
            os._exit(17)

    persisted_prefill(
        model, prompt, shard_tokens=shard_tokens, storage=storage, key=key,
        exchange=CrossRankExchange(), on_shard=on_shard,
        schedule=schedule,
    )  # fmt: skip
    return "finished"


def resume_persisted_prefill_with(
    rank: int,
    world: int,
    checkpoint: str,
    root: str,
    schedule: str,
    prompt_len: int,
    shard_tokens: int,
):
    """The rerun with `schedule` (background writers) against an uninterrupted sequential
    the sequential schedule: counts, state, committed state and exact-mode gradients."""
    from _group_gradients import dense_group_gradients
    from _workers import _persisted_setup

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.distributed.sharded_state import gather_state
    from longstraw.engine.prefill import prefill
    from longstraw.schemas.grpo import GRPOConfig
    from longstraw.storage import open_committed_state
    from longstraw.training.persisted_prefill import persisted_prefill

    model, prompt, responses, advantages, storage, key = _persisted_setup(
        checkpoint, root, prompt_len, "background"
    )
    resumed, outcome = persisted_prefill(
        model,
        prompt,
        shard_tokens=shard_tokens,
        storage=storage,
        key=key,
        exchange=CrossRankExchange(),
        schedule=schedule,
    )
    uninterrupted = prefill(model, prompt, shard_tokens=shard_tokens, exchange=CrossRankExchange())
    whole, want = gather_state(resumed).tensors(), gather_state(uninterrupted).tensors()
    committed = open_committed_state(
        outcome.ref, expect_weights_digest="weights", expect_policy_version=0, cache=None
    ).tensors
    config = GRPOConfig(beta=0.0)
    got, _ = dense_group_gradients(model, resumed, responses, advantages, config)
    ref, _ = dense_group_gradients(model, uninterrupted, responses, advantages, config)
    return {
        "resumed_at": outcome.resumed_at,
        "counts": (outcome.shards_computed, outcome.shards_reused, outcome.boundary_reads),
        "ref": outcome.ref.manifest_sha256,
        "state_bitwise": all(torch.equal(whole[n], t) for n, t in want.items()),
        "committed_bitwise": set(committed) == set(want)
        and all(torch.equal(committed[n], t) for n, t in want.items()),
        "grads_bitwise": all(torch.equal(got.grads[n], g) for n, g in ref.grads.items()),
    }


def wavefront_on_subgroups(rank: int, world: int, checkpoint: str, seq: int):
    """Sequence groups of `seq` consecutive ranks (the "seq" dimension of a 2-D mesh), each on its
    own prompt: the wavefront state against the sequential one within each subgroup."""
    import torch.distributed as dist

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.distributed.wavefront_prefill import wavefront_prefill
    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint

    groups = [dist.new_group(list(range(g, g + seq))) for g in range(0, world, seq)]
    group = groups[rank // seq]
    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (41,), generator=torch.Generator().manual_seed(rank // seq))
    want = prefill(model, prompt, shard_tokens=4, exchange=CrossRankExchange(group))
    got = wavefront_prefill(model, prompt, shard_tokens=4, group=group)
    return {
        "group_rank": got.rank,
        "bitwise": all(
            torch.equal(getattr(got, n), getattr(want, n))
            for n in STATE_FIELDS
            if getattr(want, n) is not None
        ),
    }
