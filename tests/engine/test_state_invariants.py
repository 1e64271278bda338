"""What a branch replay may not do to the prompt state: write it, copy it, or save it for backward.

No prompt-sized tensor is saved for backward during a replay (checked with
`saved_tensors_hooks`: the saved total must not grow with P), no `.grad` appears on the state, and
exact mode's fp32 cotangent dS is the only prompt-sized extra buffer.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    ENGINE_FAMILIES,
    random_group,
    stock_cached_branch_logprobs,
    stock_prefilled_cache,
    vocab_of,
)
from torch.utils._python_dispatch import TorchDispatchMode

from longstraw.engine.group import accumulate_group_gradients
from longstraw.engine.prefill import prefill
from longstraw.engine.replay import PromptCotangent, branch_logprobs, replay_branch
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig

MODES = ["no_grad", "detached_backward", "exact_backward", "group_exact"]


def _snapshot(state) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in state.tensors().items()}


def _replay(model, state, responses, advantages, mode: str) -> None:
    if mode == "group_exact":
        # Replay of every branch, then the reverse sweep that recomputes each shard from the state.
        accumulate_group_gradients(
            model,
            state,
            responses,
            advantages,
            GRPOConfig(loss_type="grpo"),
            EngineConfig(shard_tokens=state.shard_tokens, prompt_grad="exact"),
        )
        return
    for response in responses:
        if mode == "no_grad":
            with torch.no_grad():
                branch_logprobs(model, state, response)
            continue
        cotangent = PromptCotangent.zeros_like_state(state) if mode == "exact_backward" else None
        logp, branch = replay_branch(model, state, response, cotangent=cotangent)
        logp.sum().backward()
        if cotangent is not None:
            branch.add_leaf_grads_into(cotangent)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_replay_leaves_the_prompt_state_bitwise_unchanged(tiny_model, family, mode):
    model = tiny_model(family)
    prompt, responses, advantages = random_group(63, (1, 8), vocab_of(model))
    state = prefill(model, prompt, shard_tokens=20)
    before = _snapshot(state)
    _replay(model, state, responses, advantages, mode)
    for name, tensor in state.tensors().items():
        assert torch.equal(tensor, before[name]), f"{mode} wrote into {name}"
        assert tensor.grad is None, f"{mode} left a .grad on {name}"
        assert not tensor.requires_grad, f"{mode} turned {name} into a leaf"
    assert torch.equal(state.prompt_ids, prompt)


def _saved_numel(model, state, response, prompt_grad: str) -> tuple[int, int]:
    """(total, largest) numel of the non-parameter tensors autograd saves in one branch forward."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes: list[int] = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # Weights are saved by every matmul; they are the model, not the prompt.
        if tensor.untyped_storage().data_ptr() not in weights:
            sizes.append(tensor.numel())
        return tensor

    cotangent = PromptCotangent.zeros_like_state(state) if prompt_grad == "exact" else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logp = branch_logprobs(model, state, response, cotangent=cotangent)
    logp.sum().backward()  # the saved graph must also be usable
    for p in model.parameters():
        p.grad = None
    return sum(sizes), max(sizes)


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_replay_saves_nothing_that_grows_with_the_prompt(tiny_model, family):
    model = tiny_model(family)
    _, responses, _ = random_group(1, (11,), vocab_of(model))
    saved = {}
    for prompt_len in (200, 2000):
        prompt, _, _ = random_group(prompt_len, (1,), vocab_of(model))
        state = prefill(model, prompt, shard_tokens=512)
        for prompt_grad in ("detached", "exact"):
            saved[prompt_grad, prompt_len] = _saved_numel(model, state, responses[0], prompt_grad)
    for prompt_grad in ("detached", "exact"):
        assert saved[prompt_grad, 200] == saved[prompt_grad, 2000], (
            f"{prompt_grad}: saved-for-backward (total, largest) numel grows with P: {saved} "
            "(a prefix copy or concatenation is being saved)"
        )
        # Nothing saved may be as large as one layer's prefix K/V or linear-state history.
        biggest_state = max(t[0].numel() for t in state.tensors().values())
        assert saved[prompt_grad, 2000][1] < biggest_state, (saved, biggest_state)


class _LargestFreshOutput(TorchDispatchMode):
    """Largest numel among op outputs that are new memory (not a view of / write into the state
    or the cotangent): a prefix copy or concatenation would show up here."""

    def __init__(self, owned: list[torch.Tensor]):
        super().__init__()
        self.owned = {t.untyped_storage().data_ptr() for t in owned}
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.owned:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_replay_allocates_nothing_that_grows_with_the_prompt(tiny_model, family):
    """Forward + backward of one exact-mode branch at P = 1500 and 3000: the largest new tensor
    is the same (prefix attention works in chunks of 1024 keys), so nothing P-sized is copied."""
    model = tiny_model(family)
    _, responses, _ = random_group(1, (11,), vocab_of(model))
    largest = {}
    for prompt_len in (1500, 3000):
        prompt, _, _ = random_group(prompt_len, (1,), vocab_of(model))
        state = prefill(model, prompt, shard_tokens=1024)
        cotangent = PromptCotangent.zeros_like_state(state)
        owned = [*state.tensors().values()]
        owned += [t for t in vars(cotangent).values() if t is not None]
        with _LargestFreshOutput(owned) as probe:
            logp = branch_logprobs(model, state, responses[0], cotangent=cotangent)
            logp.sum().backward()
        for p in model.parameters():
            p.grad = None
        largest[prompt_len] = probe.largest
    assert largest[1500] == largest[3000], f"largest new tensor grows with P: {largest}"


def test_probes_detect_the_prefix_copy_of_a_stock_cache(tiny_model):
    """Control for the two tests above: transformers' DynamicCache concatenates prefix and branch
    K/V, and both probes see it grow with P."""
    model = tiny_model("llama")
    _, responses, _ = random_group(1, (11,), vocab_of(model))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, largest = {}, {}
    for prompt_len in (1500, 3000):
        prompt, _, _ = random_group(prompt_len, (1,), vocab_of(model))
        cache = stock_prefilled_cache(model, prompt)  # outside the probes: only the branch counts
        sizes: list[int] = []

        def pack(tensor: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
            if tensor.untyped_storage().data_ptr() not in weights:
                sizes.append(tensor.numel())
            return tensor

        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
            _LargestFreshOutput([]) as probe,
        ):
            logp = stock_cached_branch_logprobs(model, prompt, responses[0], cache=cache)
            logp.sum().backward()
        for p in model.parameters():
            p.grad = None
        saved[prompt_len], largest[prompt_len] = sum(sizes), probe.largest
    assert saved[3000] > saved[1500] + 1500 * 4 * 16, saved
    assert largest[3000] > largest[1500], largest


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_exact_mode_cotangent_is_fp32_kv_plus_constant_linear_state(tiny_model, family):
    """GroupStats bytes: dS = fp32 bytes of the K/V state (the only part that grows with P) +
    the fp32 cotangent of one conv tail and one recurrent state per linear-attention layer."""
    model = tiny_model(family)
    prompt, responses, advantages = random_group(97, (5, 3), vocab_of(model))
    state = prefill(model, prompt, shard_tokens=30)
    cfg = GRPOConfig(loss_type="grpo")
    exact = accumulate_group_gradients(
        model, state, responses, advantages, cfg, EngineConfig(shard_tokens=30)
    )
    detached = accumulate_group_gradients(
        model,
        state,
        responses,
        advantages,
        cfg,
        EngineConfig(shard_tokens=30, prompt_grad="detached"),
    )

    def numel(name: str) -> int:
        t = state.tensors().get(name)
        return 0 if t is None else t.numel()

    kv_numel = numel("full_attention/k") + numel("full_attention/v")
    num_shards_plus_one = state.num_shards + 1
    linear_numel = (
        numel("linear_attention/conv") + numel("linear_attention/recurrent")
    ) // num_shards_plus_one
    assert exact.cotangent_bytes == 4 * kv_numel + 4 * linear_numel, exact
    assert detached.cotangent_bytes == 0
    assert exact.state_bytes == state.state_bytes() == kv_numel * state.keys.element_size()
    assert exact.checkpoint_bytes == state.checkpoint_bytes()
    for name, tensor in state.tensors().items():
        assert tensor.grad is None, name
