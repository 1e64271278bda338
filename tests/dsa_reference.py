"""transformers' GLM-5 DSA indexer held to LongStraw's stable top-k tie rule, for references.

Random models score many keys exactly alike; `torch.topk` breaks such ties differently at
different lengths, so a full-sequence reference and a cached forward would select different keys
(docs/glm.md). Tests that compare against transformers' GLM-5 forward run it inside this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from longstraw.ops.dsa_topk import stable_topk_indices


@contextlib.contextmanager
def transformers_stable_topk() -> Iterator[None]:
    """transformers' DSA indexer (`index_scores.topk(k, dim=-1)`) with stable tie-breaking."""
    original = torch.Tensor.topk

    def stable(self, k, dim=-1, largest=True, sorted=True):
        if dim not in (-1, self.dim() - 1) or not largest:
            return original(self, k, dim=dim, largest=largest, sorted=sorted)
        indices = stable_topk_indices(self, k)
        return torch.return_types.topk((self.gather(-1, indices), indices))

    torch.Tensor.topk = stable
    try:
        yield
    finally:
        torch.Tensor.topk = original
