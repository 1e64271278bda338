"""Whether a change to the attention code keeps the single-process numerics bit for bit.

`record` writes, for the `longstraw` on PYTHONPATH, every output and gradient of the attention
ops (K/V: fp32 and bf16, V = D and V != D, an extra prefix, an empty prefix, several query and
key chunks; decoding; absorbed MLA, dense and sparse selection, a decoding overlay) and of the
engine on the tiny llama, qwen3_5 and glm_moe_dsa checkpoints in fp32 and bf16 (prefill state;
exact, detached and segmented group gradients; seeded samples and their log-probs), with the
prefix chunk shrunk to 32 positions so that the prompt spans several chunks. `compare` names
every tensor that differs between two recordings, with its largest difference.

    git archive <before> longstraw | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before .venv/bin/python bench/attention_numerics.py record /tmp/before.pt
    .venv/bin/python bench/attention_numerics.py record /tmp/after.pt
    .venv/bin/python bench/attention_numerics.py compare /tmp/after.pt /tmp/before.pt

Run both recordings with the same thread count (OMP_NUM_THREADS=1): reductions may split
differently with more threads.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import zlib
from pathlib import Path

import torch


def _generator(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()) % 1000)


def _kv_case(out: dict, name, dtype, batch, heads, kv_heads, rows, keys, dim, value_dim, chunk,
             extra_keys=None):  # fmt: skip
    from longstraw.ops.decode_attention import decode_attention
    from longstraw.ops.prefix_attention import prefix_cached_attention

    gen = _generator(name)

    def randn(*shape, grad=False):
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_(grad)

    q = randn(batch, heads, rows, dim, grad=True)
    kb, vb = (
        randn(batch, kv_heads, rows, dim, grad=True),
        randn(batch, kv_heads, rows, value_dim, grad=True),
    )
    kp, vp = randn(keys, kv_heads, dim), randn(keys, kv_heads, value_dim)
    grads = (torch.zeros(keys, kv_heads, dim), torch.zeros(keys, kv_heads, value_dim))
    extra = None
    if extra_keys is not None:
        extra = (randn(extra_keys, kv_heads, dim), randn(extra_keys, kv_heads, value_dim),
                 torch.zeros(extra_keys, kv_heads, dim), torch.zeros(extra_keys, kv_heads, value_dim))  # fmt: skip
    o = prefix_cached_attention(
        q, kb, vb, kp, vp, scale=dim**-0.5, chunk_size=chunk, prefix_grad_k_TKD=grads[0],
        prefix_grad_v_TKD=grads[1], extra_prefix=extra,
    )  # fmt: skip
    o.backward(randn(*o.shape))
    tensors = {
        "out": o,
        "dq": q.grad,
        "dkb": kb.grad,
        "dvb": vb.grad,
        "dkp": grads[0],
        "dvp": grads[1],
    }
    if extra is not None:
        tensors.update(dke=extra[2], dve=extra[3])
    with torch.no_grad():
        kn, vn = randn(batch, kv_heads, rows + 3, dim), randn(batch, kv_heads, rows + 3, value_dim)
        q2 = q.detach()[:, :, :2]
        tensors["decode"] = decode_attention(q2, kn, vn, kp, vp, scale=dim**-0.5, chunk_size=chunk)
    out.update({f"{name}/{k}": v.detach().clone() for k, v in tensors.items()})


def _mla_case(out: dict, name, batch, queries, branch, keys, topk):
    from longstraw.ops.mla_attention import absorbed_mla_attention

    gen = _generator(name)
    heads, nope, rope_dim, value, rank = 3, 16, 8, 24, 12

    def randn(*shape, grad=False):
        return torch.randn(*shape, generator=gen).requires_grad_(grad)

    qn, qr = (
        randn(batch, heads, queries, nope, grad=True),
        randn(batch, heads, queries, rope_dim, grad=True),
    )
    lat, rope = randn(batch, branch, rank, grad=True), randn(batch, branch, rope_dim, grad=True)
    plat, prope = randn(keys, rank), randn(keys, rope_dim)
    kv_b = (randn(heads * (nope + value), rank) * 0.3).detach().requires_grad_(True)
    selected = None
    if topk is not None:
        scores = torch.randn(batch, queries, keys + branch, generator=gen).clamp(min=0)
        query_pos = torch.arange(keys + branch - queries, keys + branch)
        visible = torch.arange(keys + branch)[None, :] <= query_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        selected = scores.topk(topk, dim=-1).indices.sort(-1).values
    grads = (torch.zeros(keys, rank), torch.zeros(keys, rope_dim))
    o = absorbed_mla_attention(
        qn, qr, lat, rope, plat, prope, kv_b, scale=0.17, selected_BSK=selected, chunk_size=16,
        prefix_grad_latent_TR=grads[0], prefix_grad_rope_TE=grads[1],
    )  # fmt: skip
    o.backward(torch.randn(o.shape, generator=gen))
    tensors = {"out": o, "dqn": qn.grad, "dqr": qr.grad, "dlat": lat.grad, "drope": rope.grad,
               "dkvb": kv_b.grad, "dplat": grads[0], "dprope": grads[1]}  # fmt: skip
    out.update({f"{name}/{k}": v.detach().clone() for k, v in tensors.items()})


def _engine_cases(out: dict) -> None:
    from longstraw.engine import attention
    from longstraw.engine.group import accumulate_group_gradients
    from longstraw.engine.prefill import prefill
    from longstraw.engine.rollout import SamplingParams, sample_responses
    from longstraw.models import glm
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.models.factory import init_model
    from longstraw.schemas.grpo import GRPOConfig
    from longstraw.schemas.run import EngineConfig

    # A prompt of several prefix chunks.
    attention.PREFIX_CHUNK_TOKENS = glm.PREFIX_CHUNK_TOKENS = 32
    root = Path(tempfile.mkdtemp(prefix="attention-numerics-"))
    for family in ("llama", "qwen3_5", "glm_moe_dsa"):
        path = init_model(family, "tiny", root / family, seed=42)
        for dtype in (torch.float32, torch.bfloat16):
            for topk in (None, 24) if family == "glm_moe_dsa" else (None,):
                tag = f"{family}_{str(dtype).split('.')[-1]}_{topk}"
                model, _, _ = load_checkpoint(path, dtype=dtype)
                model.eval()
                if topk is not None:  # GLM's sparse regime
                    model.config.index_topk = topk
                    for module in model.modules():
                        if hasattr(module, "index_topk"):
                            module.index_topk = topk
                gen = torch.Generator().manual_seed(7)
                vocab = model.config.get_text_config().vocab_size
                prompt = torch.randint(0, vocab, (101,), generator=gen)
                responses = [torch.randint(0, vocab, (n,), generator=gen) for n in (9, 4, 13)]
                advantages = torch.tensor([0.5, -1.0, 0.7])
                state = prefill(model, prompt, shard_tokens=37)
                for field in ("keys", "values", "latent", "rope_key", "indexer_key"):
                    if getattr(state, field, None) is not None:
                        out[f"{tag}/state/{field}"] = getattr(state, field).clone()
                engines = {
                    "exact": EngineConfig(shard_tokens=37, prompt_grad="exact"),
                    "detached": EngineConfig(shard_tokens=37, prompt_grad="detached"),
                    "segments": EngineConfig(shard_tokens=37, branch_segment_tokens=4),
                }
                for name, engine in engines.items():
                    model.zero_grad(set_to_none=True)
                    accumulate_group_gradients(
                        model, state, responses, advantages, GRPOConfig(beta=0.0), engine
                    )
                    for param_name, param in model.named_parameters():
                        if param.grad is not None:
                            out[f"{tag}/{name}/{param_name}"] = param.grad.clone()
                    model.zero_grad(set_to_none=True)
                params = SamplingParams(num_samples=3, max_new_tokens=6)
                samples = sample_responses(
                    model, state, params, generator=torch.Generator().manual_seed(3)
                )
                for i, response in enumerate(samples):
                    out[f"{tag}/sample{i}"] = torch.as_tensor(response.token_ids)
                    out[f"{tag}/sample_logp{i}"] = torch.as_tensor(response.logprobs)


def record(path: Path) -> None:
    import longstraw

    out: dict[str, torch.Tensor] = {}
    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).split(".")[-1]
        _kv_case(out, f"kv_{tag}_a", dtype, 2, 4, 2, 13, 45, 8, 8, 16)
        _kv_case(out, f"kv_{tag}_extra", dtype, 1, 4, 2, 9, 37, 8, 8, 16, extra_keys=21)
        _kv_case(out, f"kv_{tag}_vd", dtype, 2, 4, 2, 13, 45, 8, 6, 16)
        _kv_case(out, f"kv_{tag}_t0", dtype, 1, 4, 4, 7, 0, 8, 8, 16)
        _kv_case(out, f"kv_{tag}_long", dtype, 1, 2, 1, 300, 70, 8, 8, 32)
    _mla_case(out, "mla_dense", 2, 5, 5, 40, None)
    _mla_case(out, "mla_sparse", 1, 7, 7, 50, 12)
    _mla_case(out, "mla_t0", 1, 6, 6, 0, None)
    _mla_case(out, "mla_overlay", 1, 3, 8, 30, None)
    _engine_cases(out)
    torch.save(out, path)
    print(f"{len(out)} tensors of {Path(longstraw.__file__).parent} in {path}")


def compare(path_a: Path, path_b: Path) -> int:
    a, b = torch.load(path_a), torch.load(path_b)
    only = sorted(set(a) ^ set(b))
    if only:
        print(f"{len(only)} tensors recorded in one file only, e.g. {only[:5]}")
    differ = []
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if x.shape != y.shape:
            differ.append((key, float("nan"), float("nan")))
        elif not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item()
            differ.append((key, diff, diff / max(y.double().abs().max().item(), 1e-30)))
    for key, diff, rel in differ:
        print(f"{key}: max_diff {diff:.3e} (relative to max |b| {rel:.3e})")
    print(f"{len(differ)} of {len(set(a) & set(b))} tensors differ")
    return 1 if differ or only else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("record").add_argument("out", type=Path)
    both = sub.add_parser("compare")
    both.add_argument("a", type=Path)
    both.add_argument("b", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.command == "record":
        record(args.out)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
