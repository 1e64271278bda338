"""Functions the distributed tests run on every rank (module level: spawn imports them by name).

Each returns plain numbers so the parent process can assert on them.
"""

from __future__ import annotations

import os

import torch

from longstraw.schemas.run import EngineConfig

SEED = 42
RESPONSE_LENS = (7, 12)


def _group(vocab: int, prompt_len: int):
    gen = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
    responses = [torch.randint(0, vocab, (n,), generator=gen) for n in RESPONSE_LENS]
    return prompt, responses, torch.tensor([0.7, -1.1])


def _grad_errors(got, want) -> dict[str, float]:
    """Worst per-tensor max_diff relative to that tensor's largest entry, and global RMS-relative."""
    worst = max(
        (
            (got.grads[n] - want.grads[n]).abs().max() / want.grads[n].abs().max().clamp(min=1e-30)
        ).item()
        for n in want.grads
    )
    num = sum(((got.grads[n] - want.grads[n]) ** 2).sum() for n in want.grads) ** 0.5
    den = sum((want.grads[n] ** 2).sum() for n in want.grads) ** 0.5
    return {"max_rel": worst, "rms_rel": (num / den).item()}


def _set_index_topk(model, topk: int) -> None:
    """GLM-5: every indexer keeps `topk` positions (a large value: the dense regime)."""
    model.config.index_topk = topk
    for module in model.modules():
        if hasattr(module, "index_topk"):
            module.index_topk = topk


def _recorded_selections(model, records: list):
    """Forward hooks appending (layer, DSA selection or None) of every GLM attention call."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention

    def hook(module, args, output):
        selected = output[2]
        records.append((module.layer_idx, None if selected is None else selected.clone()))

    return [
        m.register_forward_hook(hook) for m in model.modules() if isinstance(m, GlmMoeDsaAttention)
    ]


def _same_selections(got: list, want: list) -> tuple[int, int]:
    """(calls whose selection differs, calls compared); None == None counts as equal."""
    assert [layer for layer, _ in got] == [layer for layer, _ in want]
    differ = 0
    for (_, a), (_, b) in zip(got, want, strict=True):
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            differ += 1
    return differ, len(want)


def _glm_selection_checks(model, reference, local, world, rank, prompt, responses, shard_tokens):
    """DSA selections of the sharded engine vs the single-process one, position for position."""
    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.distributed.sharded_state import scatter_state
    from longstraw.engine.prefill import prefill
    from longstraw.engine.replay import branch_logprobs, replay_branch

    out: dict = {}
    layers = model.config.num_hidden_layers
    # Prefill: this rank's owned shards against the same shards of the single-process prefill.
    want, got = [], []
    hooks = _recorded_selections(model, want)
    try:
        prefill(model, prompt, shard_tokens=shard_tokens)
    finally:
        for h in hooks:
            h.remove()
    hooks = _recorded_selections(model, got)
    try:
        prefill(model, prompt, shard_tokens=shard_tokens, exchange=CrossRankExchange())
    finally:
        for h in hooks:
            h.remove()
    owned = [want[s * layers : (s + 1) * layers] for s in local.shards]
    out["prefill_selection"] = _same_selections(got, [c for chunk in owned for c in chunk])
    out["prefill_sparse_calls"] = sum(sel is not None for _, sel in got)
    # Replay on the placed single-process state (bitwise the same prefix): isolates the global
    # top-k and the cross-rank merge from prefill's reordered sums.
    placed = scatter_state(reference, rank, world)
    want, got, diffs = [], [], []
    with torch.no_grad():
        for response in responses:
            hooks = _recorded_selections(model, want)
            try:
                w = branch_logprobs(model, reference, response)
            finally:
                for h in hooks:
                    h.remove()
            hooks = _recorded_selections(model, got)
            try:
                g, _ = replay_branch(model, placed, response, exchange=CrossRankExchange())
            finally:
                for h in hooks:
                    h.remove()
            diffs.append((w - g).abs().max().item())
    out["replay_selection"] = _same_selections(got, want)
    out["replay_sparse_calls"] = sum(sel is not None for _, sel in got)
    out["placed_replay_logp_max_diff"] = max(diffs)
    return out


def compare_with_single_process(
    rank: int,
    world: int,
    checkpoint: str,
    prompt_len: int,
    shard_tokens: int,
    index_topk: int | None = None,
):
    """Sharded prefill/replay/gradients on this rank vs the single-process engine (run here too).

    `index_topk` (GLM-5) overrides the DSA top-k; GLM runs also compare the DSA selections.
    """
    from _group_gradients import dense_group_gradients

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.distributed.sharded_state import gather_state, scatter_state
    from longstraw.engine.group import GradBuffer, accumulate_group_gradients
    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.models.glm import is_glm
    from longstraw.schemas.grpo import GRPOConfig

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    if index_topk is not None:
        _set_index_topk(model, index_topk)
    prompt, responses, advantages = _group(model.config.get_text_config().vocab_size, prompt_len)
    config = GRPOConfig(beta=0.0)
    out: dict = {}

    reference = prefill(model, prompt, shard_tokens=shard_tokens)
    placed = gather_state(scatter_state(reference, rank, world))
    out["placement_bitwise"] = all(
        torch.equal(placed.tensors()[n], t) for n, t in reference.tensors().items()
    )
    local = prefill(model, prompt, shard_tokens=shard_tokens, exchange=CrossRankExchange())
    whole = gather_state(local)
    out["state_max_rel"] = max(
        ((whole.tensors()[n] - t).abs().max() / t.abs().max()).item()
        for n, t in reference.tensors().items()
    )
    out["local_state_bytes"] = local.state_bytes()
    out["total_state_bytes"] = reference.state_bytes()
    if is_glm(model):
        out.update(
            _glm_selection_checks(
                model, reference, local, world, rank, prompt, responses, shard_tokens
            )
        )
    for mode in ("detached", "exact"):
        want = GradBuffer(model)
        stats = accumulate_group_gradients(
            model, reference, responses, advantages, config,
            EngineConfig(shard_tokens=shard_tokens, prompt_grad=mode), grad_buffer=want,
        )  # fmt: skip
        got, logps = dense_group_gradients(
            model, local, responses, advantages, config, prompt_grad=mode
        )
        out[f"{mode}_logp_max_diff"] = max(
            (torch.tensor(w) - g).abs().max().item()
            for w, g in zip(stats.branch_logprobs, logps, strict=True)
        )
        out[f"{mode}_logps"] = [g.tolist() for g in logps]
        out[f"{mode}_grad"] = _grad_errors(got, want)
    if is_glm(model) and index_topk is not None and index_topk < prompt_len:
        out["branches"] = _branch_cases_against_single_process(model, prompt_len, shard_tokens)
        # The sparse regime: each rank's latents, rope and indexer keys streamed under a budget.
        out["budget"] = _budgeted_against_resident(
            model, local, prompt, responses, advantages, config, cases=BUDGET_CASES[:2]
        )
    return out


def die_during_prefill(rank: int, world: int, checkpoint: str, dying_rank: int):
    """Rank `dying_rank` exits hard after its first prefill shard; the others are mid-collective."""
    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    prompt, _, _ = _group(model.config.get_text_config().vocab_size, 100)

    def on_shard(state, shard):
        if rank == dying_rank:
            os._exit(17)

    prefill(model, prompt, shard_tokens=20, on_shard=on_shard, exchange=CrossRankExchange())
    return "finished"


def raise_on_rank(rank: int, world: int, failing_rank: int):
    import torch.distributed as dist

    if rank == failing_rank:
        raise ValueError(f"injected failure on rank {rank}")
    dist.barrier()
    return rank


def _persisted_setup(checkpoint: str, root: str, prompt_len: int, persist_mode: str):
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.schemas.storage import StateKey, StorageConfig

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    prompt, responses, advantages = _group(model.config.get_text_config().vocab_size, prompt_len)
    storage = StorageConfig(root_uri=root, persist_mode=persist_mode)
    key = StateKey.policy("sharded", 0, "weights", "prompt")
    return model, prompt, responses, advantages, storage, key


def persisted_prefill_dying(
    rank: int,
    world: int,
    checkpoint: str,
    root: str,
    prompt_len: int,
    shard_tokens: int,
    dying_rank: int,
    dying_after_shard: int,
):
    """Persisted sharded prefill; `dying_rank` exits hard once `dying_after_shard` is recorded."""
    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.training.persisted_prefill import persisted_prefill

    model, prompt, _, _, storage, key = _persisted_setup(
        checkpoint, root, prompt_len, "synchronous"
    )

    def on_shard(state, shard):
        if rank == dying_rank and shard == dying_after_shard:
            os._exit(17)

    persisted_prefill(
        model,
        prompt,
        shard_tokens=shard_tokens,
        storage=storage,
        key=key,
        exchange=CrossRankExchange(),
        on_shard=on_shard,
    )
    return "finished"


def resume_persisted_prefill(
    rank: int, world: int, checkpoint: str, root: str, prompt_len: int, shard_tokens: int
):
    """Rerun after a crash: resume from the recorded shards; compare with an uninterrupted run."""
    from _group_gradients import dense_group_gradients

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.distributed.sharded_state import gather_state
    from longstraw.engine.prefill import prefill
    from longstraw.schemas.grpo import GRPOConfig
    from longstraw.storage import open_committed_state
    from longstraw.training.persisted_prefill import persisted_prefill

    # The rerun writes in the background (the crashed run wrote synchronously): same layout.
    model, prompt, responses, advantages, storage, key = _persisted_setup(
        checkpoint, root, prompt_len, "background"
    )
    resumed, outcome = persisted_prefill(
        model, prompt, shard_tokens=shard_tokens, storage=storage, key=key,
        exchange=CrossRankExchange(),
    )  # fmt: skip
    uninterrupted = prefill(model, prompt, shard_tokens=shard_tokens, exchange=CrossRankExchange())
    out = {
        "resumed_at": outcome.resumed_at,
        "computed": outcome.shards_computed,
        "restored": outcome.shards_reused,
        "boundary_reads": outcome.boundary_reads,
        "num_shards": resumed.num_shards,
        "ref": None if outcome.ref is None else outcome.ref.manifest_sha256,
    }
    whole, want = gather_state(resumed).tensors(), gather_state(uninterrupted).tensors()
    out["state_bitwise"] = all(torch.equal(whole[n], t) for n, t in want.items())
    committed = open_committed_state(
        outcome.ref, expect_weights_digest="weights", expect_policy_version=0, cache=None
    ).tensors
    out["committed_bitwise"] = set(committed) == set(want) and all(
        torch.equal(committed[n], t) for n, t in want.items()
    )
    config = GRPOConfig(beta=0.0)
    got, _ = dense_group_gradients(model, resumed, responses, advantages, config)
    ref, _ = dense_group_gradients(model, uninterrupted, responses, advantages, config)
    out["grads_bitwise"] = all(torch.equal(got.grads[n], g) for n, g in ref.grads.items())
    out["grad_errors"] = _grad_errors(got, ref)
    # A third run finds the state committed: everything restored, nothing computed.
    again, outcome = persisted_prefill(
        model, prompt, shard_tokens=shard_tokens, storage=storage, key=key,
        exchange=CrossRankExchange(),
    )  # fmt: skip
    out["again_computed"] = outcome.shards_computed
    out["again_bitwise"] = all(
        torch.equal(gather_state(again).tensors()[n], t) for n, t in want.items()
    )
    return out


def budgeted_sharded_sessions(
    rank: int, world: int, checkpoint: str, root: str, prompt_len: int, shard_tokens: int
):
    """Per-shard `PrefillSession` calls with each rank's slice tiered from the start
    (budget 0, disk, a 16-position grid), both schedules, against the sequential schedule."""
    import tempfile

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.engine import attention
    from longstraw.engine.layer_kinds import named_arrays
    from longstraw.engine.prefill import prefill
    from longstraw.engine.state import token_rows
    from longstraw.engine.state_tiers import StateBudget
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.schemas.storage import StateKey, StorageConfig
    from longstraw.training.persisted_prefill import PrefillSession

    attention.PREFIX_CHUNK_TOKENS = 16
    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    prompt, _, _ = _group(model.config.get_text_config().vocab_size, prompt_len)
    want = prefill(model, prompt, shard_tokens=shard_tokens, exchange=CrossRankExchange())
    out = {}
    for schedule in ("sequential", "wavefront"):
        storage = StorageConfig(root_uri=f"{root}/{schedule}", persist_mode="synchronous")
        key = StateKey.policy("budget", 0, "w" * 64, "d" * 64)
        with tempfile.TemporaryDirectory() as scratch:
            session = PrefillSession(
                model, prompt, shard_tokens=shard_tokens, storage=storage, key=key,
                schedule=schedule, budget=StateBudget(0, "disk", scratch),
                exchange=CrossRankExchange(),
            )  # fmt: skip
            for shard in range(session.num_shards):
                session.ensure_shard(shard)
            state, outcome = session.finish()
            got = named_arrays(state)
            equal = {
                name: torch.equal(
                    token_rows(got[name], 0, got[name].shape[1])
                    if hasattr(got[name], "read") else got[name], tensor,
                )
                for name, tensor in named_arrays(want).items()
            }  # fmt: skip
            equal["final_recurrent"] = torch.equal(state.final_recurrent, want.final_recurrent)
            store = state.tiers.store
            out[schedule] = {
                "equal": equal,
                "tiered": sorted(n for n, t in got.items() if hasattr(t, "read")),
                "computed": outcome.shards_computed,
                "committed": outcome.ref is not None,
                "peak": store.peak_resident_bytes,
                "chunk_unit": store.chunk_unit_bytes,
            }
            session.discard()
            out[schedule]["scratch_left"] = os.listdir(scratch)
    return out


def replica_groups(vocab: int, data: int, prompt_len: int):
    """[data] (prompt, responses, advantages): data replica d trains on its own prompt, with the
    same lengths and other tokens."""
    out = []
    for d in range(data):
        gen = torch.Generator().manual_seed(SEED + d)
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
        responses = [torch.randint(0, vocab, (n,), generator=gen) for n in RESPONSE_LENS]
        out.append((prompt, responses, torch.tensor([0.7, -1.1]) * (d + 1)))
    return out


def data_parallel_reference(
    checkpoint: str, data: int, prompt_len: int, shard_tokens: int, prompt_grad: str, lr: float
):
    """Single process: every replica's group (`replica_groups`), gradients averaged, one SGD
    step. Returns (the stepped model, the groups, the averaged fp32 GradBuffer)."""
    from longstraw.engine.group import GradBuffer, accumulate_group_gradients
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.schemas.grpo import GRPOConfig

    reference, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    reference.eval()
    batches = replica_groups(reference.config.get_text_config().vocab_size, data, prompt_len)
    want = GradBuffer(reference)
    for prompt, responses, advantages in batches:
        accumulate_group_gradients(
            reference, prompt, responses, advantages, GRPOConfig(beta=0.0),
            EngineConfig(shard_tokens=shard_tokens, prompt_grad=prompt_grad), grad_buffer=want,
        )  # fmt: skip
    for grad in want.grads.values():
        grad /= data
    want.into_param_grads(reference)
    torch.optim.SGD(reference.parameters(), lr=lr).step()
    return reference, batches, want


def fsdp_data_parallel_step(
    rank: int, world: int, checkpoint: str, data: int, prompt_len: int, shard_tokens: int
):
    """FSDP2 over "data" × sequence sharding over "seq": gradients and optimizer steps against the
    single-process engine (each data replica's group computed here too, then averaged)."""
    from _group_gradients import dense_group_gradients
    from torch.distributed.tensor import DTensor

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.distributed.fsdp import (
        SEQ,
        data_seq_mesh,
        shard_gradients_over_data,
        shard_model,
        unsharded_parameters,
    )
    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.schemas.grpo import GRPOConfig

    seq = world // data
    config = GRPOConfig(beta=0.0)
    lr = 1e-3

    reference, batches, want = data_parallel_reference(
        checkpoint, data, prompt_len, shard_tokens, "exact", lr
    )

    # FSDP over "data", this rank's share of its replica's group over "seq".
    mesh = data_seq_mesh(data, seq)
    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    modules = shard_model(model, mesh)
    prompt, responses, advantages = batches[rank // seq]
    with unsharded_parameters(modules):
        state = prefill(
            model,
            prompt,
            shard_tokens=shard_tokens,
            exchange=CrossRankExchange(mesh.get_group(SEQ)),
        )
        got, _ = dense_group_gradients(
            model, state, responses, advantages, config, group=mesh.get_group(SEQ)
        )
    shard_gradients_over_data(model, got, mesh)
    params = dict(model.named_parameters())
    out = {
        "all_dtensor": all(isinstance(p, DTensor) for p in params.values()),
        "local_numel": sum(p.to_local().numel() for p in params.values()),
        "total_numel": sum(p.numel() for p in reference.parameters()),
        "grad": max(
            ((params[n].grad.full_tensor() - g).abs().max() / g.abs().max()).item()
            for n, g in want.grads.items()
        ),
    }
    # A dense copy given the gathered FSDP gradient takes the same steps: isolates the optimizer.
    dense, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    for name, p in dense.named_parameters():
        p.grad = params[name].grad.full_tensor()
    torch.optim.SGD(model.parameters(), lr=lr).step()
    torch.optim.SGD(dense.parameters(), lr=lr).step()
    ref_params = dict(reference.named_parameters())
    # SGD: the parameter difference is lr × the gradient difference (bounded by the gradient
    # tolerance, 1e-5 of max|g|) plus the rounding of p - lr·g (2 ulp of max|p|). Ratio <= 1.
    eps = torch.finfo(torch.float32).eps
    out["sgd_vs_single_process"] = max(
        (
            (params[n].full_tensor() - p).abs().max()
            / (lr * 1e-5 * want.grads[n].abs().max() + 2 * eps * p.abs().max())
        ).item()
        for n, p in ref_params.items()
    )
    adam = torch.optim.AdamW(model.parameters(), lr=lr)
    adam.step()
    torch.optim.AdamW(dense.parameters(), lr=lr).step()
    out["adam_state_local_numel"] = sum(
        s["exp_avg"].to_local().numel() for s in adam.state.values()
    )
    out["steps_vs_dense_same_grad"] = max(
        (params[n].full_tensor() - p).abs().max().item() for n, p in dense.named_parameters()
    )
    return out


def glm_branch_traffic_and_saved_tensors(rank: int, world: int, checkpoint: str, shard_tokens: int):
    """GLM-5 replay on a sharded state: bytes each rank hands to collectives for one branch
    (forward + backward), and the largest tensor autograd saves, at two prompt lengths."""
    from longstraw.distributed.cross_rank_attention import COMM
    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.engine.prefill import prefill
    from longstraw.engine.replay import PromptCotangent, replay_branch
    from longstraw.models.checkpoint import load_checkpoint

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    vocab = model.config.get_text_config().vocab_size
    out: dict = {"saved": {}}
    for prompt_len in (100, 300):
        prompt, responses, _ = _group(vocab, prompt_len)
        state = prefill(model, prompt, shard_tokens=shard_tokens, exchange=CrossRankExchange())
        cotangent = PromptCotangent.zeros_like_state(state)
        sizes = []

        def pack(tensor, sizes=sizes):
            sizes.append(tensor.numel())
            return tensor

        before = COMM.bytes_sent
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, _ = replay_branch(
                model, state, responses[0], cotangent=cotangent, exchange=CrossRankExchange()
            )
        logp.sum().backward()
        out["saved"][prompt_len] = max(sizes)
        out[f"branch_bytes_{prompt_len}"] = COMM.bytes_sent - before
        model.zero_grad(set_to_none=True)
    out["response_len"] = responses[0].numel()
    return out


def glm_sweep_with_corrupted_latent(rank: int, world: int, checkpoint: str, shard_tokens: int):
    """The last rank's stored latent of the last prompt position is off by 1e-3 (only branches
    read it, so only the recomputation of the last shard can notice): the sweep must refuse."""
    from _group_gradients import dense_group_gradients

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.schemas.grpo import GRPOConfig

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    prompt, responses, advantages = _group(model.config.get_text_config().vocab_size, 100)
    state = prefill(model, prompt, shard_tokens=shard_tokens, exchange=CrossRankExchange())
    if rank == world - 1:
        state.latent[1, -1] += 1e-3
    dense_group_gradients(model, state, responses, advantages, GRPOConfig(beta=0.0))
    return "finished"


def _decode_bytes_per_step(model, state, rows: int, sparse: bool) -> int:
    """Bytes one rank hands to collectives per decode step of `rows` rows (the formula of
    docs/scaling.md): per full-attention layer the (out, lse) all_gather G·H·(V+1)·4; per MLA
    layer G·H·(R+1)·4, plus G·K·16 of DSA candidates per selecting layer (sparse regime); and
    the 8·G bytes of drawn ids that check the ranks drew the same."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    total = rows * 8
    spec = state.spec
    if spec.full_attention is not None:
        value_dim = state.values.shape[-1]
        total += len(spec.full_attention.layer_indices) * rows * heads * (value_dim + 1) * 4
    if spec.mla is not None:
        rank_dim = state.latent.shape[-1]
        total += len(spec.mla.layer_indices) * rows * heads * (rank_dim + 1) * 4
        if sparse:
            total += len(spec.mla.indexer_layer_indices) * rows * config.index_topk * 16
    return total


def rollout_against_single_process(
    rank: int,
    world: int,
    checkpoint: str,
    prompt_len: int,
    shard_tokens: int,
    second_prompt_len: int,
    index_topk: int | None = None,
):
    """Sharded rollout on this rank vs the single-process rollout (run here too): greedy tokens
    and log-probs, seeded sampling vs a single-process replay, stop ids, max tokens, traffic."""
    from longstraw.distributed.cross_rank_attention import COMM
    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.engine.prefill import prefill
    from longstraw.engine.rollout import SamplingParams, sample_responses, score_responses
    from longstraw.models.checkpoint import load_checkpoint

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    if index_topk is not None:
        _set_index_topk(model, index_topk)
    vocab = model.config.get_text_config().vocab_size
    prompt, _, _ = _group(vocab, prompt_len)
    reference = prefill(model, prompt, shard_tokens=shard_tokens)
    local = prefill(model, prompt, shard_tokens=shard_tokens, exchange=CrossRankExchange())

    def generator(seed: int = SEED) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    def sharded(params, state=local, seed=SEED):
        before = COMM.bytes_sent
        got = sample_responses(
            model, state, params, generator=generator(seed), exchange=CrossRankExchange()
        )
        return got, COMM.bytes_sent - before

    def summary(responses):
        return [(r.token_ids, r.logprobs, r.finish_reason) for r in responses]

    def logp_diff(got, want) -> float:
        return max(
            (torch.tensor(g.logprobs) - torch.as_tensor(w)).abs().max().item()
            for g, w in zip(got, want, strict=True)
        )

    out: dict = {"sparse": index_topk is None or index_topk < prompt_len + 32}
    # Greedy (top_k = 1): the single-process tokens.
    greedy = SamplingParams(num_samples=2, max_new_tokens=9, top_k=1)
    want_selections, got_selections = [], []
    hooks = _recorded_selections(model, want_selections)
    try:
        want = sample_responses(model, reference, greedy, generator=generator())
    finally:
        for h in hooks:
            h.remove()
    hooks = _recorded_selections(model, got_selections)
    try:
        got, sent = sharded(greedy)
    finally:
        for h in hooks:
            h.remove()
    # GLM-5: every decode step's DSA selection, row by row, against the single-process one.
    out["decode_selection"] = _same_selections(got_selections, want_selections)
    out["decode_sparse_calls"] = sum(sel is not None for _, sel in got_selections)
    out["greedy"] = summary(got)
    out["greedy_tokens_equal"] = [g.token_ids for g in got] == [w.token_ids for w in want]
    out["greedy_logp_max_diff"] = logp_diff(got, [w.logprobs for w in want])
    out["greedy_bytes"] = sent
    out["greedy_bytes_formula"] = 9 * _decode_bytes_per_step(model, local, 2, out["sparse"])
    # Greedy with a stop id first emitted at step >= 2: the single-process response, cut there.
    tokens = want[0].token_ids
    cut = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    stop = SamplingParams(num_samples=2, max_new_tokens=9, top_k=1, stop_token_ids=(tokens[cut],))
    want_stop = sample_responses(model, reference, stop, generator=generator())
    got_stop, _ = sharded(stop)
    out["greedy_stop"] = summary(got_stop)
    out["greedy_stop_equal"] = summary(got_stop) == [
        (w.token_ids, g.logprobs, w.finish_reason) for w, g in zip(want_stop, got_stop, strict=True)
    ]
    out["greedy_stop_len"] = cut + 1
    # Seeded sampling: every rank the same; log-probs vs a single-process replay of the tokens.
    sampling = SamplingParams(
        num_samples=4, max_new_tokens=10, temperature=0.8, top_p=0.95, top_k=50
    )
    got, _ = sharded(sampling)
    out["sampled"] = summary(got)
    replay = score_responses(model, reference, [g.token_ids for g in got], temperature=0.8)
    out["sampled_vs_replay_max_diff"] = logp_diff(got, replay)
    single = sample_responses(model, reference, sampling, generator=generator())
    out["sampled_equals_single_process"] = [g.token_ids for g in got] == [
        s.token_ids for s in single
    ]
    # The same seed with stop ids drawn at step 3 of rows 0 and 1: each row is the run above cut
    # at its first stop id (the generator is consumed the same way), decoding ends early.
    stops = (got[0].token_ids[3], got[1].token_ids[3])
    stopped, sent = sharded(
        SamplingParams(
            num_samples=4, max_new_tokens=10, temperature=0.8, top_p=0.95, top_k=50,
            stop_token_ids=stops,
        )
    )  # fmt: skip
    out["sampled_stop"] = summary(stopped)
    out["sampled_stop_ids"] = stops
    out["sampled_stop_bytes"] = sent
    out["bytes_per_step"] = _decode_bytes_per_step(model, local, 4, out["sparse"])
    out["agent"] = _agent_branches_against_single_process(model, reference, local, vocab)
    # Traffic does not grow with the prompt: the same greedy decode on a longer prompt.
    longer = prefill(
        model,
        _group(vocab, second_prompt_len)[0],
        shard_tokens=shard_tokens,
        exchange=CrossRankExchange(),
    )
    _, out["greedy_bytes_second_prompt"] = sharded(greedy, state=longer)
    return out


class _ScriptedFraming:
    """Chat framing of fixed ids (no tokenizer): an observation's ids spell its text's length."""

    turn_stop_ids = ()

    def __init__(self, vocab: int):
        self.vocab = vocab

    def close_turn(self, stop_id):
        return [5]

    def observation(self, text: str):
        return [7, 11 + len(text) % (self.vocab - 11), 13]


class _ScriptedEnvironment:
    """Answers turn n with an n-character observation, done after `turns` turns; raises at turn
    `fail_at`. Counts its calls in `calls` (class-wide: every instance of the process)."""

    calls = 0

    def __init__(self, turns: int = 3, fail_at: int | None = None):
        self.turns, self.fail_at, self.seen = turns, fail_at, 0

    def reset(self, metadata):
        type(self).calls += 1

    def step(self, text):
        type(self).calls += 1
        self.seen += 1
        if self.seen == self.fail_at:
            raise RuntimeError(f"tool failed at turn {self.seen}")
        return "x" * self.seen, self.seen >= self.turns, float(self.seen)


def _agent_branches_against_single_process(model, reference, local, vocab) -> dict:
    """Agent trajectories (greedy and seeded, and one whose tool fails) sampled on the ranks
    against the same trajectories sampled by one process on the whole state."""
    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.engine.agent_rollout import TurnLimits, sample_agent_group
    from longstraw.engine.rollout import SamplingParams

    framing = _ScriptedFraming(vocab)
    limits = TurnLimits(max_turns=4, max_turn_tokens=3, max_branch_tokens=40)

    def trajectories(state, params, exchange=None, **env):
        kwargs = {} if exchange is None else {"exchange": exchange}
        return [
            (t.token_ids, t.loss_mask, t.logprobs, t.finish_reason, t.reward, t.error)
            for t in sample_agent_group(
                model, state, lambda: _ScriptedEnvironment(**env), {}, framing, limits, params,
                generator=torch.Generator().manual_seed(SEED), **kwargs,
            )
        ]  # fmt: skip

    out = {}
    for name, params, env in (
        ("greedy", SamplingParams(num_samples=2, max_new_tokens=3, top_k=1), {}),
        ("sampled", SamplingParams(num_samples=2, max_new_tokens=3, temperature=0.8), {}),
        ("failing", SamplingParams(num_samples=1, max_new_tokens=3, top_k=1), {"fail_at": 2}),
    ):
        want = trajectories(reference, params, **env)
        before = _ScriptedEnvironment.calls
        got = trajectories(local, params, CrossRankExchange(), **env)
        out[name] = {
            "got": got,
            "tokens_equal": [g[:2] + g[3:] for g in got] == [w[:2] + w[3:] for w in want],
            "logp_max_diff": max(
                abs(a - b)
                for g, w in zip(got, want, strict=True)
                for a, b in zip(g[2], w[2], strict=False)
            ),
            "environment_calls": _ScriptedEnvironment.calls - before,
        }
    return out


def rollout_with_divergent_seed(rank: int, world: int, checkpoint: str, diverging_rank: int):
    """`diverging_rank` seeds its generator differently: every rank must refuse, not hang."""
    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.engine.prefill import prefill
    from longstraw.engine.rollout import SamplingParams, sample_responses
    from longstraw.models.checkpoint import load_checkpoint

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    prompt, _, _ = _group(model.config.get_text_config().vocab_size, 60)
    state = prefill(model, prompt, shard_tokens=17, exchange=CrossRankExchange())
    seed = SEED + (1 if rank == diverging_rank else 0)
    params = SamplingParams(num_samples=8, max_new_tokens=4)
    generator = torch.Generator().manual_seed(seed)
    sample_responses(model, state, params, generator=generator, exchange=CrossRankExchange())
    return "finished"


def _shared_prefix_group(vocab: int, prompt_len: int):
    """A prompt and three responses that share turns: r0 (10 tokens) is a prefix of r2 (13);
    r1 (13) leaves them after 6 tokens. Their prefix tree has a shared 6-token node, a node
    where r0 ends, and two leaves."""
    gen = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
    base = torch.randint(0, vocab, (13,), generator=gen)
    other = torch.randint(0, vocab, (7,), generator=gen)
    responses = [base[:10], torch.cat([base[:6], other]), base]
    return prompt, responses, torch.tensor([0.7, -1.1, 0.4])


# (name, prompt_grad, branch_segment_tokens, share_response_prefixes)
BRANCH_CASES = (
    ("segments", "exact", 4, False),
    ("segments_detached", "detached", 4, False),
    ("prefix_tree", "exact", None, True),
    ("prefix_tree_in_segments", "exact", 3, True),
)


def branches_against_single_process(rank: int, world: int, checkpoint: str, prompt_len: int,
                                    shard_tokens: int):  # fmt: skip
    """Segmented and prefix-tree replay over this rank's slice vs the single-process engine
    with the same engine options (run here too): gradient errors and log-probs per case."""
    from longstraw.models.checkpoint import load_checkpoint

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    return _branch_cases_against_single_process(model, prompt_len, shard_tokens, budget=True)


def _branch_cases_against_single_process(model, prompt_len, shard_tokens, budget=False) -> dict:
    """`BRANCH_CASES` on this rank's slice vs one process (and, with `budget`, the budgeted
    cases against the resident slice)."""
    from _group_gradients import dense_group_gradients

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.engine.group import GradBuffer, accumulate_group_gradients
    from longstraw.engine.prefill import prefill
    from longstraw.schemas.grpo import GRPOConfig

    vocab = model.config.get_text_config().vocab_size
    prompt, responses, advantages = _shared_prefix_group(vocab, prompt_len)
    config = GRPOConfig(beta=0.0)
    reference = prefill(model, prompt, shard_tokens=shard_tokens)
    local = prefill(model, prompt, shard_tokens=shard_tokens, exchange=CrossRankExchange())
    out: dict = {}
    for name, mode, segment_tokens, share in BRANCH_CASES:
        engine = EngineConfig(
            shard_tokens=shard_tokens,
            prompt_grad=mode,
            branch_segment_tokens=segment_tokens,
            share_response_prefixes=share,
        )
        want = GradBuffer(model)
        stats = accumulate_group_gradients(
            model, reference, responses, advantages, config, engine, grad_buffer=want
        )
        got, logps = dense_group_gradients(
            model, local, responses, advantages, config, prompt_grad=mode,
            branch_segment_tokens=segment_tokens, share_response_prefixes=share,
        )  # fmt: skip
        out[name] = {
            "grad": _grad_errors(got, want),
            "logp_max_diff": max(
                (torch.tensor(w) - g).abs().max().item()
                for w, g in zip(stats.branch_logprobs, logps, strict=True)
            ),
            "logps": [g.tolist() for g in logps],
        }
    if budget:
        out["budget"] = _budgeted_against_resident(
            model, local, prompt, responses, advantages, config
        )
    return out


# Replay options run on a tiered slice of the sharded state (name, prompt_grad, segments, tree).
BUDGET_CASES = (
    ("whole", "exact", None, False),
    ("detached", "detached", None, False),
    ("segments_in_tree", "exact", 3, True),
)
# Prefix positions per chunk while the budgeted cases run: every rank's slice (66 and 53
# positions) and every sweep prefix is cut into several chunks.
BUDGET_CHUNK_TOKENS = 16


def _budgeted_against_resident(
    model, local, prompt, responses, advantages, config, cases=BUDGET_CASES
) -> dict:
    """Each rank's slice tiered under a budget of 0 (every chunk streamed, host and disk)
    against the same slice resident: gradients, log-probs and sampled tokens, bit for bit, for
    each of `cases` (`BUDGET_CASES` rows)."""
    import tempfile

    from _group_gradients import dense_group_gradients

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.engine import attention
    from longstraw.engine.prefill import prefill
    from longstraw.engine.rollout import SamplingParams, sample_responses
    from longstraw.engine.state_tiers import state_traffic, tiered_for_group
    from longstraw.models import glm

    def same(a, b) -> bool:
        return a.grads.keys() == b.grads.keys() and all(
            torch.equal(a.grads[n], b.grads[n]) for n in a.grads
        )

    sampling = SamplingParams(num_samples=3, max_new_tokens=5, temperature=0.9)

    def sample(state):
        drawn = sample_responses(
            model, state, sampling, generator=torch.Generator().manual_seed(SEED),
            exchange=CrossRankExchange(),
        )  # fmt: skip
        return [(r.token_ids, r.logprobs) for r in drawn]

    out: dict = {}
    previous = attention.PREFIX_CHUNK_TOKENS, glm.PREFIX_CHUNK_TOKENS
    attention.PREFIX_CHUNK_TOKENS = glm.PREFIX_CHUNK_TOKENS = BUDGET_CHUNK_TOKENS
    try:
        # The prefill on the same grid: the exact sweep checks its recomputation bitwise.
        local = prefill(
            model, prompt, shard_tokens=local.shard_tokens, exchange=CrossRankExchange()
        )
        want_samples = sample(local)
        for name, mode, segment_tokens, share in cases:
            options = dict(
                prompt_grad=mode, branch_segment_tokens=segment_tokens,
                share_response_prefixes=share,
            )  # fmt: skip
            want, want_logps = dense_group_gradients(
                model, local, responses, advantages, config, **options
            )
            for tier in ("host", "disk"):
                with tempfile.TemporaryDirectory() as scratch:
                    with tiered_for_group(
                        model, local, 0, tier, scratch, exact=mode == "exact"
                    ) as tiered:
                        got, logps = dense_group_gradients(
                            model, tiered, responses, advantages, config, **options
                        )
                        samples = sample(tiered) if name == "whole" else want_samples
                        traffic = state_traffic(tiered)
                        unit = tiered.tiers.store.chunk_unit_bytes
                    left = os.listdir(scratch)
                out[f"{name}-{tier}"] = {
                    "grads_equal": same(got, want),
                    "logps_equal": all(
                        torch.equal(a, b) for a, b in zip(logps, want_logps, strict=True)
                    ),
                    "samples_equal": samples == want_samples,
                    "bytes_read": traffic.bytes_read,
                    "bytes_written": traffic.bytes_written,
                    "peak": traffic.peak_resident_bytes,
                    "chunk_unit": unit,
                    "state_bytes": local.state_bytes(),
                    "scratch_left": left,
                }
    finally:
        attention.PREFIX_CHUNK_TOKENS, glm.PREFIX_CHUNK_TOKENS = previous
    return out
