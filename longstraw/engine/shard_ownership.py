"""Which prefill shards this process holds, and what it does about the ones it does not.

Prefill (`engine.prefill`) and the reverse sweep (`engine.sweep`) walk the global shards in
order; a shard is computed or recomputed where it is held. One process holds them all. On a
sequence group (`longstraw.distributed.shard_ownership.CrossRankShards`) each rank holds a
contiguous range: while the owner computes a shard, the others serve it their prefix; at an
ownership boundary the linear-attention state (and in the sweep its cotangent) is handed over.
"""

from __future__ import annotations

from longstraw.engine.state import WHOLE, Placement


class ShardOwnership:
    """One process holds every shard of the state."""

    def placement(self) -> Placement:
        """Which part of a prompt state this process holds."""
        return WHOLE

    @property
    def recomputes_layers(self) -> bool:
        """Whether a sweep shard's decoder layers may keep only their inputs and recompute in
        backward (`engine.sweep.layerwise_recompute`), so that the shard's graph holds one
        layer's activations at a time."""
        return True

    def shard_name(self, state, shard: int) -> str:
        """How errors name shard `shard`."""
        del state
        return f"shard {shard}"

    def hand_over_start_state(self, state, shard: int) -> None:
        """`shard` starts its owner's range: its start state is the previous owner's end state."""
        raise AssertionError(f"shard {shard} starts another rank's range, but there is one process")

    def share_final_state(self, state) -> None:
        """After the last shard: the final linear-attention state (one process: its last
        checkpoint already)."""
        del state

    def finish_owned_shard(self, state) -> None:
        """After this process computed or swept a shard it holds (the ranks: release the
        servers)."""
        del state

    def serve_shard(self, model, state, shard: int, cotangent, on_gradient_slices) -> None:
        """Answer the prefill (`cotangent` None) or the sweep of `shard`, held by another
        rank."""
        raise AssertionError(f"shard {shard} is held by another rank, but there is one process")

    def hand_back_start_cotangent(self, state, cotangent, shard: int) -> None:
        """`shard` starts its owner's range: its start-state cotangent is the end-state
        cotangent of the previous owner's last shard."""
        raise AssertionError(f"shard {shard} starts another rank's range, but there is one process")


ALL_SHARDS_HERE = ShardOwnership()
