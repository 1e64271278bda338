"""LongStraw: GRPO on million-token prompts: prefill once without autograd, replay branches one at
a time, recover the exact prompt gradient by a reverse sweep.

The engine works on a plain `transformers` model:

>>> import tempfile, torch
>>> from transformers import AutoModelForCausalLM
>>> from longstraw import EngineConfig, GRPOConfig, accumulate_group_gradients, branch_logprobs, prefill
>>> from longstraw.models.factory import init_model
>>> path = init_model("qwen3_5", "tiny", tempfile.mkdtemp() + "/qwen35-tiny", seed=42)
>>> model = AutoModelForCausalLM.from_pretrained(path).eval()
>>> prompt = torch.randint(0, model.config.vocab_size, (301,), generator=torch.Generator().manual_seed(42))
>>> state = prefill(model, prompt, shard_tokens=128)         # no autograd; K/V + recurrent state
>>> state.num_shards, state.num_tokens
(3, 300)
>>> branch_logprobs(model, state, [5, 17, 3]).shape           # [R] log-probs of one response
torch.Size([3])
>>> stats = accumulate_group_gradients(                       # one group, one branch at a time
...     model, state, [[5, 17, 3], [9, 2]], [1.0, -1.0], GRPOConfig(loss_type="dapo"),
...     EngineConfig(prompt_grad="exact"))                    # exact: through the prompt state
>>> all(p.grad is not None for p in model.parameters())
True
>>> len(stats.branch_losses), stats.num_shards
(2, 3)

A whole run is a `RunConfig` (`longstraw train --config run.yaml`, docs/config.md):

>>> from longstraw import RunConfig
>>> RunConfig.model_validate({"run_id": "r1", "parallel": {"world_size": 2}}).parallel.world_size
2
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# The public names, imported on first use (PEP 562) so that `import longstraw` and the CLI's
# --help stay fast: the engine pulls in torch and transformers.
_EXPORTS = {
    "prefill": "longstraw.engine.prefill",
    "branch_logprobs": "longstraw.engine.replay",
    "accumulate_group_gradients": "longstraw.engine.group",
    "sample_responses": "longstraw.engine.rollout",
    "score_responses": "longstraw.engine.rollout",
    "PrefixState": "longstraw.engine.state",
    "GRPOConfig": "longstraw.schemas.grpo",
    "EngineConfig": "longstraw.schemas.run",
    "RunConfig": "longstraw.schemas.run",
    "train": "longstraw.training.loop",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'longstraw' has no attribute {name!r}")
