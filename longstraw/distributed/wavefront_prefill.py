"""Sequence-sharded prefill on a layer wavefront: every rank computes at once, same bits.

Legend: L decoder layers, N ranks, r this rank, t a wavefront step, B H R D V as in
`longstraw.ops.prefix_attention` (R = one shard's queries).

`sharded_prefill` walks global shards in order: the owner of a shard computes it through all
layers while the other ranks only serve, so N ranks divide memory by N but not time. Cell
(layer l, shard s) needs only (l - 1, s) and layer l's K/V and linear state of the shards before
s, so here rank r computes layer l of all its shards at step t = l + r: L + N - 1 steps of
(its shards × one layer) instead of L · N shard-layers one after another. One step, on every
rank, with l = t - r:

  A. each owned shard runs layer l up to its attention call (full-attention layers; the K/V
     are written into the state before the call), and its queries leave at once for every
     earlier rank (one message per shard and earlier rank) — or through the layer (Gated
     DeltaNet); then rank r's end-of-range linear state of layer l goes to rank r + 1, which
     starts layer l from it at step t + 1;
  B. every earlier rank answers with the partial (out, lse) of those queries over ALL its
     positions of layer l (finished: it ran layer l at an earlier step) — as soon as they have
     arrived (watched by receive threads; looked at between its own shards and while it
     waits), then the rest;
  C. each shard finishes layer l: the same attention op as `sharded_prefill`'s owner, with the
     same N partials in rank order (earlier ranks', its own over its earlier positions, an
     empty one per later rank), then the causal in-shard part — so the state is bitwise
     `sharded_prefill`'s. With
     `attention_window` w, shard s finishes before shard s + w starts its attention (memory).

No rank receives another rank's K/V. Only point-to-point messages between the ranks that need
them, each with a tag naming its shard and kind; every rank derives the same plan from (t, the
layer kinds, the shard ranges) and posts all of a step's receives when the step starts. Nothing
waits on anything that waits on it — queries depend on no message of the step, partials only on
queries, the linear state on nothing — so a step cannot deadlock, and which message arrives
first changes no value. A rank that dies closes its connections; the others raise out of their
wait (or time out with the group's timeout) and `run_on_ranks` names it.

How one layer of one shard runs without a per-family decoder driver: each owned shard runs the
ordinary `run_shard_forward` (transformers' decoder: embeddings, rotary, masks, layer kwargs)
with the engine's attention (`engine.attention`; GLM-5: its MLA forward) in its own thread,
paused by forward pre-hooks at every decoder layer and inside the attention op — its layers'
ranks (`_WavefrontKvRanks`, `_WavefrontLatentRanks`) pause where the sequential owner's would
broadcast — until this rank's main thread, which does all communication, resumes it. The threads are coroutines: exactly one thread of a rank computes at any moment, in
a fixed order, so the result does not depend on thread timing. (Receive-watching threads only
wait on messages, see `_Arrivals`; which message arrives first changes no value.)

GLM-5's MLA + DSA layers pause twice on a selecting layer — ("select", indexer queries) -> the
earlier ranks' local top-k candidates, then ("mla", absorbed queries + selection) -> their
partials — and once otherwise (dense regime, `shared` layers); the candidates and partials are
completed and merged in `sharded_prefill`'s order by the same selection and op. Resume works as in
`sharded_prefill`; persistence records shards only when the whole wavefront is done
(`training.persisted_prefill.PrefillSession(..., schedule="wavefront")` on the ranks). See docs/scaling.md, "Schedule".
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import PreTrainedModel

from longstraw.distributed.cross_rank_attention import COMM, pack_partial, partial_chunk_tokens
from longstraw.distributed.cross_rank_mla import (
    LatentRanks,
    attention_modules,
    pack_index_queries,
    pack_latent_queries,
    serve_candidates,
    serve_latent_partial,
)
from longstraw.distributed.exchange import CrossRankExchange
from longstraw.distributed.layer_placement import owner_prefill_cache
from longstraw.engine.attention import prefix_attention_enabled
from longstraw.engine.prefill import prefill_target, prompt_tensor, run_shard_forward
from longstraw.engine.state import PrefixState, rank_shard_ranges
from longstraw.models.adapters import attention_scales, decoder_of
from longstraw.models.glm import local_topk_candidates
from longstraw.ops.prefix_attention import prefix_partial

# Message kinds, part of every point-to-point tag (tag = shard * _KINDS + kind). GLM-5's MLA
# layers: _QUERY carries the absorbed queries, _PARTIAL the latent partials, and a selecting layer
# adds _INDEX_QUERY (indexer queries) -> _CANDIDATES (local top-k), and _SELECTION.
_QUERY, _PARTIAL, _CONV, _RECURRENT, _INDEX_QUERY, _CANDIDATES, _SELECTION = range(7)
_KINDS = 7
# Seconds a rank waits for a paused shard thread to join at the end (they are all finished).
_JOIN_S = 30.0
# No message at all for this long while waiting: a rank is stuck (gloo's default timeout).
_STALL_S = 1800.0

_current = threading.local()


class _Aborted(BaseException):
    """Raised inside a paused shard thread when the wavefront is abandoned (another error)."""


class _ShardThread:
    """One owned shard's decoder forward, paused at layer boundaries and attention calls.

    Reports to the main thread: ("layer", l) paused before decoder layer l, ("attention",
    q_s) paused inside layer l's attention with its scaled queries, ("done", None) after the
    last layer. Exactly one of a rank's threads runs at a time: `resume` waits for the report.
    """

    def __init__(self, model: PreTrainedModel, state: PrefixState, shard: int, group):
        self.shard = shard
        # GLM-5's MLA layers exchange through the main thread (pauses), not collectives.
        cache = owner_prefill_cache(
            state, shard, group=group, kv_ranks=_WavefrontKvRanks,
            latent_ranks=_WavefrontLatentRanks,
        )  # fmt: skip
        self._args = (model, state.prompt_ids, cache, *state.bounds[shard])
        self._resume: queue.Queue = queue.Queue(maxsize=1)
        self._report: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(
            target=self._run, name=f"wavefront-shard-{shard}", daemon=True
        )
        self.running = False

    # ---- main thread side
    def start(self) -> tuple[str, object]:
        self._thread.start()
        self.running = True
        return self._wait_report()

    def resume(self, value: object = None) -> tuple[str, object]:
        self._resume.put(value)
        return self._wait_report()

    def _wait_report(self) -> tuple[str, object]:
        kind, payload = self._report.get()
        if kind == "error":
            self.running = False
            raise payload
        if kind == "done":
            self.running = False
        return kind, payload

    def abort(self) -> None:
        if self.running:
            self.running = False
            self._resume.put(_Aborted)

    def join(self) -> None:
        self._thread.join(timeout=_JOIN_S)

    # ---- shard thread side
    def _run(self) -> None:
        _current.shard_thread = self
        try:
            # Grad mode is per thread: the prefill keeps no graph (and uses no_grad, not
            # inference_mode, like every other prefill: replays save views of the state).
            with torch.no_grad():
                run_shard_forward(*self._args)
        except _Aborted:
            return
        except BaseException as exc:  # handed to the main thread, which raises it
            self._report.put(("error", exc))
            return
        self._report.put(("done", None))

    def pause(self, kind: str, payload: object) -> object:
        self._report.put((kind, payload))
        value = self._resume.get()
        if value is _Aborted:
            raise _Aborted
        return value


def _pause_before_layer(layer_idx: int):
    def hook(module, args):
        shard_thread = getattr(_current, "shard_thread", None)
        if shard_thread is not None:
            shard_thread.pause("layer", layer_idx)

    return hook


class _WavefrontKvRanks:
    """A full-attention layer's `PrefixRanks` in the wavefront: the shard thread pauses with its
    queries, the main thread sends them to the earlier ranks and resumes it with their partials.
    This rank's own partial over its earlier positions (the op's) and an empty partial per later
    rank complete them, so the merge sees the same N partials in the same order as
    `sharded_prefill`'s owner."""

    replicated = False

    def __init__(self, group, owner: int, slot: int):
        del owner, slot
        self.world = dist.get_world_size(group)
        self.earlier: list[tuple[Tensor, Tensor]] = []

    def queries_ready(self, q_BHRD: Tensor, scale: float) -> None:
        self.earlier = _current.shard_thread.pause("attention", (q_BHRD.contiguous(), scale))

    def gather(self, out_BHRV: Tensor, lse_BHR: Tensor) -> list[tuple[Tensor, Tensor]]:
        earlier, self.earlier = self.earlier, []
        empty = (torch.zeros_like(out_BHRV), torch.full_like(lse_BHR, float("-inf")))
        return [*earlier, (out_BHRV, lse_BHR), *[empty] * (self.world - len(earlier) - 1)]

    def cotangent_ready(self, *tensors: Tensor) -> None:
        raise AssertionError("the wavefront prefill keeps no graph")

    reduce = cotangent_ready


class _WavefrontLatentRanks(LatentRanks):
    """GLM-5's `LatentRanks` in the wavefront, both exchanges done by the main thread.

    The shard thread pauses with ("select", packed indexer queries) and gets the earlier ranks'
    local top-k candidates, then with ("mla", (packed absorbed queries, selection)) and gets
    their packed partials. This rank's own share and the empty shares of later ranks are
    computed here with the functions their owners would use, so the candidates and the partials
    reach `global_topk` / the merge in the same order with the same bits as in
    `sharded_prefill`'s all_gathers.
    """

    def __init__(self, group, owner: int, layer: int, *, num_prefix: int, local_start: int):
        super().__init__(group, owner, layer, num_prefix=num_prefix, local_start=local_start)
        self.world = dist.get_world_size(group)
        self.earlier: list[Tensor] = []

    def _later(self, earlier: int) -> int:
        return self.world - earlier - 1

    def gather_candidates(self, indexer, q_BSHD, weights_BSH, index_TD):
        earlier = _current.shard_thread.pause("select", pack_index_queries(q_BSHD, weights_BSH))
        topk = indexer.index_topk
        own = local_topk_candidates(indexer, q_BSHD, weights_BSH, index_TD, self.local_start, topk)
        empty = local_topk_candidates(indexer, q_BSHD, weights_BSH, index_TD[:0], 0, topk)
        return [*earlier, own, *[empty] * self._later(len(earlier))]

    def queries_ready(self, q_lat_BHSR, q_rot_BHSE, selected_BSK, needs_grad: bool) -> None:
        assert not needs_grad, "the wavefront prefill keeps no graph"
        packed_q = pack_latent_queries(q_lat_BHSR, q_rot_BHSE)
        self.earlier = _current.shard_thread.pause("mla", (packed_q, selected_BSK))

    def gather(self, out_BHSR: Tensor, lse_BHS: Tensor) -> list[tuple[Tensor, Tensor]]:
        earlier = [(packed[..., :-1], packed[..., -1]) for packed in self.earlier]
        self.earlier = []
        empty = (torch.zeros_like(out_BHSR), torch.full_like(lse_BHS, float("-inf")))
        return [*earlier, (out_BHSR, lse_BHS), *[empty] * self._later(len(earlier))]

    def cotangent_ready(self, *tensors: Tensor) -> None:
        raise AssertionError("the wavefront prefill keeps no graph")

    reduce = cotangent_ready


@contextlib.contextmanager
def _wavefront_installed(model: PreTrainedModel) -> Iterator[None]:
    """The ranks' attention and the per-layer pause hooks, for the duration of the block."""
    handles = [
        layer.register_forward_pre_hook(_pause_before_layer(i))
        for i, layer in enumerate(decoder_of(model).layers)
    ]
    try:
        with prefix_attention_enabled(model):
            yield
    finally:
        for handle in handles:
            handle.remove()


class _Plan:
    """What every rank derives identically: which layer each rank runs at a step, message shapes."""

    def __init__(self, model: PreTrainedModel, state: PrefixState, start_shard: int) -> None:
        spec = state.spec
        self.state = state
        # The shards each rank computes (resume: those from `start_shard` on; a rank whose
        # shards are all restored computes none but still answers queries and hands on state).
        self.computed = [
            [shard for shard in owned if shard >= start_shard]
            for owned in rank_shard_ranges(state.num_shards, state.world_size)
        ]
        self.num_layers = spec.num_layers
        fa, la = spec.full_attention, spec.linear_attention
        self.full_slot = {} if fa is None else {i: s for s, i in enumerate(fa.layer_indices)}
        self.linear_slot = {} if la is None else {i: s for s, i in enumerate(la.layer_indices)}
        heads = model.config.get_text_config().num_attention_heads
        # K/V queries travel in the model's dtype (what the attention receives) with the layer's
        # own scale; partials in the attention's compute dtype (fp32 for fp32/bf16).
        self.scales = attention_scales(model)
        self.query_dtype = model.dtype
        self.query_dims = None if fa is None else (heads, fa.head_dim)
        self.partial_dims = None if fa is None else (heads, fa.value_head_dim + 1)
        self.device = model.device
        # GLM-5: MLA slot = layer index; the indexer whose selection layer l uses (its own, or a
        # `shared` layer's previous full layer; None: no selection at all).
        self.mla = mla = spec.mla
        self.mla_layers = frozenset() if mla is None else frozenset(mla.layer_indices)
        if mla is not None:
            self.mla_modules = attention_modules(model)
            indexed = mla.indexer_layer_indices
            self.selection_source = {
                layer: max((i for i in indexed if i <= layer), default=None)
                for layer in mla.layer_indices
            }
            if indexed:
                indexer = self.mla_modules[indexed[0]].indexer
                self.index_query_dims = (indexer.n_heads, indexer.head_dim + 1)
            self.latent_query_dims = (heads, mla.kv_lora_rank + mla.rope_dim)
            self.latent_partial_dims = (heads, mla.kv_lora_rank + 1)

    def topk(self, layer: int) -> int:
        return self.mla_modules[self.selection_source[layer]].indexer.index_topk

    def sparse(self, layer: int, shard: int) -> bool:
        """Whether `shard`'s queries at MLA layer `layer` attend a DSA selection (T + X > K)."""
        source = self.selection_source[layer]
        return source is not None and self.state.bounds[shard][1] > self.topk(layer)

    def selects(self, layer: int, shard: int) -> bool:
        """Whether `shard` exchanges indexer queries / candidates at `layer` (its own indexer,
        a selection, positions before it)."""
        return (
            self.selection_source[layer] == layer
            and self.sparse(layer, shard)
            and self.state.bounds[shard][0] > 0
        )

    def tensor(self, *shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.empty(*shape, dtype=dtype, device=self.device)

    def length(self, shard: int) -> int:
        start, end = self.state.bounds[shard]
        return end - start

    @property
    def num_steps(self) -> int:
        return self.num_layers + self.state.world_size - 1

    def layer_of(self, rank: int, step: int) -> int | None:
        layer = step - rank
        return layer if 0 <= layer < self.num_layers else None

    def buffer(
        self, shard: int, dims: tuple[int, int], dtype: torch.dtype = torch.float32
    ) -> Tensor:
        start, end = self.state.bounds[shard]
        return torch.empty(1, dims[0], end - start, dims[1], dtype=dtype, device=self.device)


class _Arrivals:
    """A step's receives, reported as they complete.

    gloo's point-to-point works say nothing about completion until waited on (`is_completed()`
    stays False), so one thread per stream — one peer's receives of one kind, posted in the
    order that peer sends them — waits on them in turn and reports each key to the rank's main
    thread, which can then answer whatever has arrived without blocking on one message.
    """

    def __init__(self) -> None:
        self._reports: queue.Queue = queue.Queue()
        self.arrived: set = set()

    def watch(self, keyed_works: list[tuple[object, object]]) -> None:
        def wait_in_turn() -> None:
            try:
                for key, work in keyed_works:
                    work.wait()
                    self._reports.put((key, None))
            except BaseException as exc:  # handed to the main thread, which raises it
                self._reports.put((None, exc))

        if keyed_works:
            threading.Thread(target=wait_in_turn, name="wavefront-recv", daemon=True).start()

    def collect(self, *, block: bool) -> None:
        """Mark every reported key (with `block`, wait for at least one first)."""
        try:
            item = self._reports.get(timeout=_STALL_S) if block else self._reports.get_nowait()
        except queue.Empty:
            if block:
                raise TimeoutError(
                    f"no message for {_STALL_S:.0f} s in the wavefront: a rank is stuck"
                ) from None
            return
        while True:
            key, error = item
            if error is not None:
                raise error
            self.arrived.add(key)
            try:
                item = self._reports.get_nowait()
            except queue.Empty:
                return


class _Step:
    """This rank's messages of one wavefront step.

    Every receive is posted when the step starts (all shapes are known from the plan); sends are
    posted as soon as their data exists. Later ranks' queries are answered as soon as they have
    arrived (looked for between this rank's shards, and whenever it waits), so an earlier rank's
    own layer overlaps the later rank's attention. Nothing waits on anything that waits on it:
    queries depend on no message of the step, partials only on queries (and a waiting rank keeps
    answering), the linear state on nothing.
    """

    def __init__(self, plan: _Plan, step: int, group) -> None:
        state = plan.state
        self.plan, self.step, self.group = plan, step, group
        self.rank = rank = state.rank
        self.layer = plan.layer_of(rank, step)
        self.sends: list = []
        self.linear_recvs: list = []
        self.arrivals = _Arrivals()
        # Later ranks' queries: (requester, shard, buffer, GLM selection buffer or None),
        # answered in `serve_ready`; GLM's indexer queries: (requester, shard, buffer).
        self.requests: list[tuple[int, int, Tensor, Tensor | None]] = []
        self.index_requests: list[tuple[int, int, Tensor]] = []
        for other in range(rank + 1, state.world_size):
            other_layer = plan.layer_of(other, step)
            if other_layer in plan.full_slot:
                stream = []
                for shard in plan.computed[other]:
                    q = plan.buffer(shard, plan.query_dims, plan.query_dtype)
                    stream.append(((_QUERY, other, shard), self._recv(q, other, shard, _QUERY)))
                    self.requests.append((other, shard, q, None))
                self.arrivals.watch(stream)
            elif other_layer in plan.mla_layers:
                self._post_mla_requests(other, other_layer)
        # Earlier ranks' partials for this rank's queries: packed buffers per shard, rank order.
        self.partials: dict[int, list[Tensor]] = {}
        if self.layer in plan.full_slot:
            streams: list[list] = [[] for _ in range(rank)]
            for shard in plan.computed[rank]:
                self.partials[shard] = []
                for other in range(rank):
                    packed = plan.buffer(shard, plan.partial_dims)
                    work = self._recv(packed, other, shard, _PARTIAL)
                    streams[other].append(((_PARTIAL, other, shard), work))
                    self.partials[shard].append(packed)
            for stream in streams:
                self.arrivals.watch(stream)
        # GLM-5: earlier ranks' candidates (selecting layers) and packed partials per shard.
        self.candidates: dict[int, list[Tensor]] = {}
        if self.layer in plan.mla_layers:
            self._post_mla_answers()
        previous = None if rank == 0 else plan.layer_of(rank - 1, step)
        if previous in plan.linear_slot:
            # Layer `previous` of this rank's first shard starts from it at the next step.
            slot, last = plan.linear_slot[previous], state.shards[0] - 1
            for buffer, kind in (
                (state.conv[slot, 0], _CONV),
                (state.recurrent[slot, 0], _RECURRENT),
            ):
                self.linear_recvs.append(self._recv(buffer, rank - 1, last, kind))

    def _post_mla_requests(self, other: int, layer: int) -> None:
        """Receives of a later rank's MLA requests at `layer`: one stream per kind (each kind is
        sent in shard order; the kinds interleave differently with the attention window)."""
        plan = self.plan
        streams: dict[int, list] = {_INDEX_QUERY: [], _QUERY: [], _SELECTION: []}

        def post(buffer: Tensor, shard: int, kind: int) -> Tensor:
            streams[kind].append(((kind, other, shard), self._recv(buffer, other, shard, kind)))
            return buffer

        for shard in plan.computed[other]:
            length = plan.length(shard)
            if plan.selects(layer, shard):
                q_index = plan.tensor(1, length, *plan.index_query_dims)
                self.index_requests.append((other, shard, post(q_index, shard, _INDEX_QUERY)))
            q = post(plan.buffer(shard, plan.latent_query_dims), shard, _QUERY)
            selection = None
            if plan.sparse(layer, shard):
                selection = plan.tensor(1, length, plan.topk(layer), dtype=torch.int64)
                post(selection, shard, _SELECTION)
            self.requests.append((other, shard, q, selection))
        for stream in streams.values():
            self.arrivals.watch(stream)

    def _post_mla_answers(self) -> None:
        """Receives of the earlier ranks' candidates and partials for this rank's shards."""
        plan, layer = self.plan, self.layer
        streams: list[list] = [[] for _ in range(2 * self.rank)]
        for shard in plan.computed[self.rank]:
            self.candidates[shard], self.partials[shard] = [], []
            for other in range(self.rank):
                if plan.selects(layer, shard):
                    shape = (1, plan.length(shard), plan.topk(layer), 2)
                    found = plan.tensor(*shape, dtype=torch.float64)
                    work = self._recv(found, other, shard, _CANDIDATES)
                    streams[2 * other].append(((_CANDIDATES, other, shard), work))
                    self.candidates[shard].append(found)
                packed = plan.buffer(shard, plan.latent_partial_dims)
                work = self._recv(packed, other, shard, _PARTIAL)
                streams[2 * other + 1].append(((_PARTIAL, other, shard), work))
                self.partials[shard].append(packed)
        for stream in streams:
            self.arrivals.watch(stream)

    def _recv(self, buffer: Tensor, src: int, shard: int, kind: int):
        return dist.irecv(buffer, group=self.group, group_src=src, tag=shard * _KINDS + kind)

    def _send(self, tensor: Tensor, dst: int, shard: int, kind: int) -> None:
        COMM.add(tensor)
        work = dist.isend(tensor, group=self.group, group_dst=dst, tag=shard * _KINDS + kind)
        self.sends.append(work)

    def send_queries(self, shard: int, q_s: Tensor) -> None:
        for other in range(self.rank):
            self._send(q_s, other, shard, _QUERY)

    def send_request(self, shard: int, kind: str, payload) -> None:
        """A paused shard's queries to every earlier rank ("attention": K/V queries; GLM-5:
        "select" packed indexer queries, "mla" packed absorbed queries and the selection)."""
        plan, layer = self.plan, self.layer
        if kind == "attention":
            q, scale = payload
            expected = plan.buffer(shard, plan.query_dims, plan.query_dtype)
            if (q.shape, q.dtype) != (expected.shape, expected.dtype):
                raise RuntimeError(
                    f"queries of shape {tuple(q.shape)} in {q.dtype}, expected "
                    f"{tuple(expected.shape)} in {expected.dtype}: this family's attention is not "
                    "supported by wavefront_prefill; use sharded_prefill"
                )
            assert scale == plan.scales[layer], "the earlier ranks scale by the layer's own scale"
            self.send_queries(shard, q)
            return
        if kind == "select":
            assert plan.selects(layer, shard), (layer, shard)
            for other in range(self.rank):
                self._send(payload, other, shard, _INDEX_QUERY)
            return
        assert kind == "mla", kind
        q, selection = payload
        if (selection is not None) != plan.sparse(layer, shard):
            raise RuntimeError(f"layer {layer} shard {shard}: DSA regime differs from the plan")
        for other in range(self.rank):
            self._send(q, other, shard, _QUERY)
            if selection is not None:
                self._send(selection.contiguous(), other, shard, _SELECTION)

    def answers(self, shard: int, kind: str) -> list:
        """What a paused shard resumes with: the earlier ranks' answers, in rank order."""
        if kind == "attention":
            return self.earlier_partials(shard)
        code, found = (
            (_CANDIDATES, self.candidates) if kind == "select" else (_PARTIAL, self.partials)
        )
        keys = [(code, other, shard) for other in range(self.rank)]
        self._serve_until(lambda: all(key in self.arrivals.arrived for key in keys))
        return found[shard]

    def send_linear_state(self) -> None:
        """The end-of-range state of this step's Gated DeltaNet layer, to the next rank."""
        state = self.plan.state
        if self.layer not in self.plan.linear_slot or self.rank + 1 == state.world_size:
            return
        slot, last = self.plan.linear_slot[self.layer], state.shards[-1]
        self._send(state.conv[slot, -1].contiguous(), self.rank + 1, last, _CONV)
        self._send(state.recurrent[slot, -1].contiguous(), self.rank + 1, last, _RECURRENT)

    def serve_ready(self) -> None:
        """Answer the later ranks' queries that have arrived: the partial over ALL of this
        rank's positions of the requester's layer (finished: this rank ran it at an earlier
        step), packed as `_gather_partials` packs it."""
        self.arrivals.collect(block=False)
        plan, arrived = self.plan, self.arrivals.arrived
        state, pending, index_pending = plan.state, [], []
        for request in self.index_requests:
            # GLM-5: this rank's local top-k candidates, as `serve_mla_owner` computes them.
            requester, shard, q_index = request
            if (_INDEX_QUERY, requester, shard) not in arrived:
                index_pending.append(request)
                continue
            layer = plan.layer_of(requester, self.step)
            index_TD = state.indexer_key[plan.mla.indexer_slot(layer)]
            indexer = plan.mla_modules[layer].indexer
            found = serve_candidates(indexer, q_index, index_TD, state.token_start)
            self._send(found, requester, shard, _CANDIDATES)
        self.index_requests = index_pending
        for request in self.requests:
            requester, shard, q, selection = request
            if (_QUERY, requester, shard) not in arrived or (
                selection is not None and (_SELECTION, requester, shard) not in arrived
            ):
                pending.append(request)
                continue
            layer = plan.layer_of(requester, self.step)
            if layer in plan.mla_layers:
                # GLM-5: the partial over this rank's selected latents, as `serve_mla_owner`.
                slot = plan.mla.layer_indices.index(layer)
                out, lse = serve_latent_partial(
                    q, state.latent[slot], state.rope_key[slot], selection, state.token_start,
                    plan.mla_modules[layer].scaling,
                )  # fmt: skip
                self._send(pack_partial(out, lse), requester, shard, _PARTIAL)
                continue
            slot = plan.full_slot[layer]
            out, lse = prefix_partial(
                q, state.keys[slot], state.values[slot], scale=plan.scales[layer],
                chunk_size=partial_chunk_tokens(),
            )  # fmt: skip
            self._send(pack_partial(out, lse), requester, shard, _PARTIAL)
        self.requests = pending

    def _serve_until(self, done: Callable[[], bool]) -> None:
        """Answer arriving queries until `done()`: a rank never waits without answering, so
        every wait ends (a rank's partials come from lower ranks, which keep answering)."""
        while True:
            self.serve_ready()
            if done():
                return
            self.arrivals.collect(block=True)

    def serve_all(self) -> None:
        """Answer every later rank's queries of this step."""
        self._serve_until(lambda: not self.requests and not self.index_requests)

    def earlier_partials(self, shard: int) -> list[tuple[Tensor, Tensor]]:
        """The earlier ranks' (out, lse) for `shard`'s queries, in rank order (views, as the
        sequential owner unpacks its all_gather), answering queries while they arrive."""
        keys = [(_PARTIAL, other, shard) for other in range(self.rank)]
        self._serve_until(lambda: all(key in self.arrivals.arrived for key in keys))
        return [(packed[..., :-1], packed[..., -1]) for packed in self.partials[shard]]

    def finish(self) -> None:
        for work in (*self.sends, *self.linear_recvs):
            work.wait()


def _run_step(threads: list[_ShardThread], plan: _Plan, step: int, group, window: int) -> None:
    """One wavefront step on this rank (module docstring: phases A, B, C); at most `window`
    owned shards are paused inside their attention call at once."""
    messages = _Step(plan, step, group)
    layer = messages.layer
    if layer in plan.full_slot or layer in plan.mla_layers:
        # Shards paused for the earlier ranks' answers, oldest first, with what they wait for.
        waiting: collections.deque[tuple[_ShardThread, str]] = collections.deque()

        def advance(thread: _ShardThread, report: tuple[str, object]) -> None:
            kind, payload = report
            if kind in ("layer", "done"):
                return  # layer finished (GLM-5: a shard with no prefix pauses nowhere)
            assert kind in ("attention", "select", "mla"), (kind, layer)
            # A: the queries leave at once.
            messages.send_request(thread.shard, kind, payload)
            waiting.append((thread, kind))

        for thread in threads:
            # A: up to the attention call (GLM-5 selecting layers: the indexer queries first).
            advance(thread, thread.resume())
            if layer in plan.full_slot:
                assert waiting and waiting[-1][0] is thread, "no attention call"
            messages.serve_ready()
            while len(waiting) >= window or (waiting and thread is threads[-1]):
                # C: the earlier ranks' answers (GLM-5 candidates: select, then send the
                # absorbed queries; partials: merge, finish the layer).
                oldest, kind = waiting.popleft()
                advance(oldest, oldest.resume(messages.answers(oldest.shard, kind)))
    elif layer is not None:
        # A for a Gated DeltaNet layer: through it, then the end state to the next rank.
        for thread in threads:
            kind, _ = thread.resume()
            assert kind in ("layer", "done"), (kind, layer)
            messages.serve_ready()
        messages.send_linear_state()
    # B: answer every later rank's queries of this step.
    messages.serve_all()
    messages.finish()


def wavefront_prefill(
    model: PreTrainedModel,
    prompt_ids: Tensor | Sequence[int],
    *,
    shard_tokens: int,
    group: dist.ProcessGroup | None = None,
    on_shard: Callable[[PrefixState, int], None] | None = None,
    resume: PrefixState | None = None,
    start_shard: int = 0,
    attention_window: int | None = None,
) -> PrefixState:
    """This rank's slice of the prompt state of `prompt_ids[:-1]`, bitwise `sharded_prefill`'s
    (same placement, same bits), computed on the layer wavefront; call on every rank together.

    `attention_window`: at most this many owned shards are paused inside a full-attention call
    at once, each holding its layer input, projections and queries (None: all of them — the
    most overlap and the most memory; 1: a shard's attention finishes before the next one's
    starts). The bits do not depend on it.

    `resume` / `start_shard` as in `sharded_prefill`: owned shards before `start_shard` are
    restored, not recomputed (their K/V answer queries; a rank's restored end state is handed on
    layer by layer). A shard is complete only when its last layer is, at the end of the
    wavefront: `on_shard(state, s)` then runs for every computed owned shard in order — a crash
    mid-wavefront loses this call's work (the sequential schedule loses one shard's).
    """
    if attention_window is not None and attention_window < 1:
        raise ValueError(f"attention_window must be >= 1 or None, got {attention_window}")
    exchange = CrossRankExchange(group)
    state = prefill_target(
        model, prompt_tensor(model, prompt_ids), shard_tokens=shard_tokens, resume=resume,
        start_shard=start_shard, exchange=exchange,
    )  # fmt: skip
    plan = _Plan(model, state, start_shard)
    threads = [_ShardThread(model, state, shard, group) for shard in plan.computed[state.rank]]
    window = max(1, len(threads)) if attention_window is None else attention_window
    with torch.no_grad(), _wavefront_installed(model):
        try:
            for thread in threads:
                report = thread.start()
                assert report == ("layer", 0), report
            for step in range(plan.num_steps):
                _run_step(threads, plan, step, group, window)
            assert not any(thread.running for thread in threads), "a shard did not finish"
        finally:
            for thread in threads:
                thread.abort()
            for thread in threads:
                thread.join()
        if on_shard is not None:
            for thread in threads:
                on_shard(state, thread.shard)
        exchange.shards.share_final_state(state)
    return state
