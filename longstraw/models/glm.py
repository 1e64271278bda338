"""GLM-5 (`glm_moe_dsa`) adapter: MLA attention over the latent prompt state, DSA selection, MoE.

Legend: B batch rows, S queries of this forward, X branch positions so far (X = S unless decoding
keeps an overlay), T prefix positions, H heads, R latent rank, E rope dim, Hi / Di indexer heads /
key dim, K `index_topk`.

transformers' `GlmMoeDsaAttention.forward` caches the latents but re-expands *every* cached latent
into per-head K/V with `kv_b_proj` on each forward and masks with dense [S, T] masks (docs/design.md:
5.2 GB at 16K tokens on a tiny config), and its DSA top-k breaks ties differently at different
lengths. Neither can be changed through transformers' extension points, so inside
`mla_attention_installed(model)` each attention module's `forward` is replaced by
`longstraw_mla_forward` below; everything else (embeddings, norms, RoPE tables, MoE, the decoder
loop, lm_head) is transformers' own code. The replacement computes the same function:

- the same projections, norms and interleaved RoPE as transformers (its own helpers are called);
- the indexer exactly as `GlmMoeDsaIndexer.forward` (under no_grad, fp32 scores, relu, per-head
  weights), scored against the stored prefix indexer keys chunk by chunk plus the branch's own,
  then a stable top-k (`longstraw.ops.dsa_topk`: ties to the earlier position); with T + X <=
  `index_topk` every position is selected and the selection is skipped (the dense regime); on
  the ranks of a sequence group the global top-k of every rank's local top-k candidates;
- `shared` layers reuse the previous layer's selection, passed up the decoder loop in the slot
  transformers uses for `prev_topk_indices`;
- absorbed MLA on the latents (`longstraw.ops.mla_attention`), the prefix merged by log-sum-exp
  (on the ranks, every rank's part of the prefix: its cache layer's `ranks`).

MoE: the router and experts are transformers' and position-wise. The model is called without
`output_router_logits`, so no auxiliary load-balancing loss is computed on prompt or branch
tokens, exactly as TRL's GRPO loss with transformers' default (`output_router_logits=False`).
The router's `e_score_correction_bias` is a buffer (no gradient); the expert choice is a discrete
top-k (no gradient through the choice; the gates `topk_weights` are differentiable).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
    GlmMoeDsaAttention,
    apply_rotary_pos_emb_interleave,
)

from longstraw.models.lora import linear_weight
from longstraw.models.patching import forwards_replaced
from longstraw.ops.dsa_topk import global_topk, stable_topk_indices, stable_topk_mask
from longstraw.ops.mla_attention import absorbed_mla_attention

# Prefix positions per chunk for the latent attention and the indexer scores.
PREFIX_CHUNK_TOKENS = 1024


def is_glm(model: PreTrainedModel) -> bool:
    return getattr(model.config.get_text_config(), "model_type", None) == "glm_moe_dsa"


@torch.no_grad()
def indexer_query_key(indexer, hidden_BSH, q_resid_BSQ, position_embeddings):
    """(q [B, S, Hi, Di], k [B, S, Di], weights [B, S, Hi] fp32) as `GlmMoeDsaIndexer.forward`."""
    batch, length, _ = hidden_BSH.shape
    cos, sin = position_embeddings
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid_BSQ).view(batch, length, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = torch.split(q, [rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_BSH)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    weights = indexer.weights_proj(hidden_BSH.to(indexer.weights_proj.weight.dtype)).float()
    return q, k, weights * (indexer.n_heads**-0.5)


def index_scores(indexer, q_BSHD, weights_BSH, keys_XD):
    """[B, S, X] index scores of keys [X, Di] or [B, X, Di] (transformers' op order)."""
    keys = keys_XD.transpose(-1, -2).float()
    keys = keys.unsqueeze(0) if keys.dim() == 2 else keys
    scores_BSHX = F.relu(torch.matmul(q_BSHD.float(), keys.unsqueeze(1)) * indexer.softmax_scale)
    return torch.matmul(weights_BSH.unsqueeze(-2), scores_BSHX).squeeze(-2)


def _prefix_index_scores(indexer, q_BSHD, weights_BSH, index_TD) -> list[torch.Tensor]:
    """[B, S, C] index scores of the prefix keys, chunk by chunk (no per-head [S, Hi, T] block)."""
    return [
        index_scores(indexer, q_BSHD, weights_BSH, index_TD[s : s + PREFIX_CHUNK_TOKENS])
        for s in range(0, index_TD.shape[0], PREFIX_CHUNK_TOKENS)
    ]


@torch.no_grad()
def dsa_selection(
    indexer, q_BSHD, weights_BSH, prefix_index_TD, branch_index_BXD, ranks=None
) -> torch.Tensor | None:
    """[B, S, K] selected positions (ascending, in [0, T + X)), or None when all are selected.

    Scores are [B, S, T + X] fp32 (one shard × the prefix in prefill). `ranks`
    (`longstraw.distributed.cross_rank_mla.LatentRanks`): the prefix keys given are this rank's
    part of the `ranks.num_prefix` the queries see; every rank's local top-k candidates
    (`local_topk_candidates`) are gathered and the branch's own added: the K best of them are
    the selection of all positions (`global_topk`).
    """
    batch, queries = q_BSHD.shape[:2]
    branch_len = branch_index_BXD.shape[1]
    num_prefix = prefix_index_TD.shape[0] if ranks is None else ranks.num_prefix
    topk = indexer.index_topk
    if num_prefix + branch_len <= topk:
        return None
    branch_BSX = index_scores(indexer, q_BSHD, weights_BSH, branch_index_BXD)
    query_pos = torch.arange(branch_len - queries, branch_len, device=q_BSHD.device)
    hidden_SX = torch.arange(branch_len, device=q_BSHD.device)[None, :] > query_pos[:, None]
    branch_BSX = branch_BSX.masked_fill(hidden_SX, float("-inf"))
    if ranks is None:
        parts = _prefix_index_scores(indexer, q_BSHD, weights_BSH, prefix_index_TD)
        keep_BSL = stable_topk_mask(torch.cat([*parts, branch_BSX], dim=-1), topk)
        # Exactly `topk` per row; nonzero() walks rows in order, so each row's positions ascend.
        return keep_BSL.nonzero()[:, 2].view(batch, queries, topk)
    parts = []
    if num_prefix > 0:
        parts = ranks.gather_candidates(indexer, q_BSHD, weights_BSH, prefix_index_TD)
    branch_pos_BSX = num_prefix + torch.arange(branch_len, device=q_BSHD.device)
    branch_BSX2 = torch.stack(
        [branch_BSX.double(), branch_pos_BSX.double().expand(batch, queries, branch_len)], dim=-1
    )
    return global_topk(torch.cat([*parts, branch_BSX2], dim=2), topk)


def local_topk_candidates(
    indexer, q_BSHD, weights_BSH, index_TD, local_start: int, topk: int
) -> torch.Tensor:
    """[B, S, K, 2] float64 (score, global position) of the best K of the prefix positions
    [local_start, local_start + T_r) whose indexer keys are `index_TD` (stable rule), padded
    with (-inf, +inf) when there are fewer than K: a rank's share of `dsa_selection`. Positions
    travel as float64 (exact to 2^53)."""
    batch, queries = q_BSHD.shape[:2]
    out = torch.empty(batch, queries, topk, 2, dtype=torch.float64, device=q_BSHD.device)
    out[..., 0], out[..., 1] = float("-inf"), float("inf")
    num = index_TD.shape[0]
    if num == 0:
        return out
    scores_BST = torch.cat(_prefix_index_scores(indexer, q_BSHD, weights_BSH, index_TD), dim=-1)
    if num > topk:
        index_BSK = stable_topk_indices(scores_BST, topk)
        scores_BSK = scores_BST.gather(-1, index_BSK)
    else:
        index_BSK = torch.arange(num, device=q_BSHD.device).expand(batch, queries, num)
        scores_BSK = scores_BST
    kept = index_BSK.shape[-1]
    out[..., :kept, 0] = scores_BSK.double()
    out[..., :kept, 1] = (index_BSK + local_start).double()
    return out


class MlaInputs(NamedTuple):
    """What one GLM attention forward computes from its hidden states, before any state is read."""

    q_nope_BHSN: torch.Tensor
    q_rot_BHSE: torch.Tensor
    """Query rope part after RoPE."""
    latent_BSR: torch.Tensor
    """This forward's latents after `kv_a_layernorm` (the state it adds)."""
    rope_BSE: torch.Tensor
    """This forward's shared rope keys after RoPE."""
    index_q_BSHD: torch.Tensor | None
    """Indexer queries (None on `shared` layers, which have no indexer)."""
    index_key_BSD: torch.Tensor | None
    index_weights_BSH: torch.Tensor | None


def mla_inputs(
    self: GlmMoeDsaAttention,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> MlaInputs:
    """The projections, norms and interleaved RoPE of transformers' forward (its modules and
    helper)."""
    batch, length = hidden_states.shape[:-1]
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q_BHSD = self.q_b_proj(q_resid).view(batch, length, -1, self.qk_head_dim).transpose(1, 2)
    q_nope, q_rot = torch.split(q_BHSD, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    compressed = self.kv_a_proj_with_mqa(hidden_states)
    kv_pass, k_rot = torch.split(compressed, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    latent_BSR = self.kv_a_layernorm(kv_pass)
    k_rot = k_rot.view(batch, 1, length, self.qk_rope_head_dim)
    cos, sin = position_embeddings
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    index_q = index_key = index_weights = None
    if self.indexer is not None:
        index_q, index_key, index_weights = indexer_query_key(
            self.indexer, hidden_states, q_resid, position_embeddings
        )
    return MlaInputs(q_nope, q_rot, latent_BSR, k_rot[:, 0], index_q, index_key, index_weights)


def kv_b_weight(self: GlmMoeDsaAttention) -> torch.Tensor:
    """[H * (N + V), R] the weight absorbed into queries and outputs: `kv_b_proj`'s, with its
    LoRA adapter's delta when it has one (`longstraw.models.lora.linear_weight`): the absorbed
    attention never calls the module, so an adapter there is seen only through its weight."""
    return linear_weight(self.kv_b_proj, where="GLM's absorbed latent attention (kv_b_proj)")


def previous_selection(self: GlmMoeDsaAttention, prev_topk_indices: torch.Tensor | None):
    """A `shared` layer's selection: the previous full layer's (None: it selected everything)."""
    if "full" not in self.config.indexer_types[: self.layer_idx]:
        # transformers raises the same way for a `shared` first layer.
        raise ValueError("Shared DSA layers require top-k indices from a previous full layer.")
    return prev_topk_indices


def longstraw_mla_forward(
    self: GlmMoeDsaAttention,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    cache=None,
    position_ids: torch.Tensor | None = None,
    prev_topk_indices: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """`GlmMoeDsaAttention.forward` on LongStraw's latent state (a `PrefixMlaLayer` in `cache`:
    the whole prefix, or this rank's part of it with the `LatentRanks` that reads the rest)."""
    if cache is None or not hasattr(cache.layers[self.layer_idx], "prefix_latent_TR"):
        raise RuntimeError(
            "LongStraw's GLM attention needs a longstraw StateCache with MLA layers; run the model "
            "through longstraw.engine or outside `mla_attention_installed`"
        )
    layer = cache.layers[self.layer_idx]
    batch, length = hidden_states.shape[:-1]
    inputs = mla_inputs(self, hidden_states, position_embeddings)
    latent_BXR, rope_BXE, index_BXD = layer.update(
        inputs.latent_BSR, inputs.rope_BSE, inputs.index_key_BSD
    )
    ranks = layer.ranks
    if ranks is not None and not ranks.replicated and latent_BXR.shape[1] != length:
        raise RuntimeError(
            "decoding over a sequence-sharded prefix runs replicated and without autograd "
            "(engine.rollout over CrossRankExchange); replay the sampled responses for gradients"
        )
    if self.indexer is not None:
        selected = dsa_selection(
            self.indexer,
            inputs.index_q_BSHD,
            inputs.index_weights_BSH,
            layer.prefix_index_TD,
            index_BXD,
            ranks=ranks,
        )
    else:
        selected = previous_selection(self, prev_topk_indices)

    out_BHSV = absorbed_mla_attention(
        inputs.q_nope_BHSN,
        inputs.q_rot_BHSE,
        latent_BXR,
        rope_BXE,
        layer.prefix_latent_TR,
        layer.prefix_rope_TE,
        kv_b_weight(self),
        scale=self.scaling,
        selected_BSK=selected,
        chunk_size=PREFIX_CHUNK_TOKENS,
        prefix_grad_latent_TR=layer.grad_latent_TR,
        prefix_grad_rope_TE=layer.grad_rope_TE,
        ranks=ranks,
    )
    out = out_BHSV.transpose(1, 2).reshape(batch, length, -1)
    # The selection rides up the decoder loop where transformers passes `prev_topk_indices`.
    return self.o_proj(out), None, selected


@contextlib.contextmanager
def mla_attention_installed(model: PreTrainedModel) -> Iterator[None]:
    """Inside the block, every GLM attention module of `model` runs `longstraw_mla_forward`."""
    modules = [m for m in model.modules() if isinstance(m, GlmMoeDsaAttention)]
    with forwards_replaced((m, longstraw_mla_forward) for m in modules):
        yield
