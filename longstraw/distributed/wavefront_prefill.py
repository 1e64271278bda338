"""Sequence-sharded prefill on a layer wavefront: every rank computes at once, same bits.

Legend: L decoder layers, N ranks, r this rank, t a wavefront step, B H R D V as in
`partial_attention` (R = one shard's queries).

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
  C. each shard finishes layer l: the same merge as `sharded_prefill`'s owner — the N partials in
     rank order (earlier ranks', its own over its earlier positions, an empty one per later
     rank), then the causal in-shard part — so the state is bitwise `sharded_prefill`'s. With
     `attention_window` w, shard s finishes before shard s + w starts its attention (memory).

No rank receives another rank's K/V. Only point-to-point messages between the ranks that need
them, each with a tag naming its shard and kind; every rank derives the same plan from (t, the
layer kinds, the shard ranges) and posts all of a step's receives when the step starts. Nothing
waits on anything that waits on it — queries depend on no message of the step, partials only on
queries, the linear state on nothing — so a step cannot deadlock, and which message arrives
first changes no value. A rank that dies closes its connections; the others raise out of their
wait (or time out with the group's timeout) and `run_on_ranks` names it.

How one layer of one shard runs without a per-family decoder driver: each owned shard runs the
ordinary `run_shard_forward` (transformers' decoder: embeddings, rotary, masks, layer kwargs) in
its own thread, paused by forward pre-hooks at every decoder layer and inside the attention
function ("longstraw_wavefront") until this rank's main thread, which does all communication,
resumes it. The threads are coroutines: exactly one thread of a rank computes at any moment, in
a fixed order, so the result does not depend on thread timing. (Receive-watching threads only
wait on messages, see `_Arrivals`; which message arrives first changes no value.)

Not covered: GLM-5's MLA + DSA layers (their select-then-attend exchange would need a third
round per step; `NotImplementedError` names `sharded_prefill`). Resume works as in
`sharded_prefill`; persistence records shards only when the whole wavefront is done
(`persisted_sharded_prefill(..., schedule="wavefront")`). See docs/scaling.md, "Schedule".
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
from transformers import AttentionInterface, PreTrainedModel

from longstraw.distributed.cross_rank_attention import (
    CHUNK_TOKENS,
    COMM,
    CrossRankAttentionLayer,
)
from longstraw.distributed.partial_attention import causal_partial, merge_partials, prefix_partial
from longstraw.distributed.sharded_prefill import (
    broadcast_final_linear_state,
    owner_prefill_cache,
    prefill_target,
)
from longstraw.distributed.sharded_state import ShardedPrefixState, rank_shard_ranges
from longstraw.engine.attention import CACHE_KWARG
from longstraw.engine.prefill import run_shard_forward
from longstraw.models.adapters import decoder_of
from longstraw.models.glm import is_glm

ATTENTION_NAME = "longstraw_wavefront"
# Message kinds, part of every point-to-point tag (tag = shard * _KINDS + kind).
_QUERY, _PARTIAL, _CONV, _RECURRENT = range(4)
_KINDS = 4
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

    def __init__(self, model: PreTrainedModel, state: ShardedPrefixState, shard: int, group):
        self.shard = shard
        cache = owner_prefill_cache(state, shard, group=group)
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


def wavefront_attention(
    module: torch.nn.Module,
    query_BHRD: Tensor,
    key_BKRD: Tensor,
    value_BKRV: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """`_CrossRankAttention`'s owner-mode forward, with the exchange done by the main thread.

    The partials of earlier ranks arrive through `pause`; this rank's own partial over its
    earlier positions and the empty partials of later ranks are computed here, so the merge
    sees the same N + 1 partials in the same order as `sharded_prefill`'s owner.
    """
    cache = kwargs.get(CACHE_KWARG)
    layer = None if cache is None else cache.layers[module.layer_idx]
    shard_thread = getattr(_current, "shard_thread", None)
    if not isinstance(layer, CrossRankAttentionLayer) or shard_thread is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} runs only inside wavefront_prefill"
        )
    scale = scaling if scaling is not None else query_BHRD.shape[-1] ** -0.5
    dtype = torch.promote_types(query_BHRD.dtype, torch.float32)
    q_s = (query_BHRD.to(dtype) * float(scale)).contiguous()
    earlier: list[tuple[Tensor, Tensor]] = shard_thread.pause("attention", q_s)
    own = prefix_partial(q_s, layer.prefix_k_TKD, layer.prefix_v_TKD, chunk_size=CHUNK_TOKENS)
    empty = prefix_partial(
        q_s, layer.prefix_k_TKD[:0], layer.prefix_v_TKD[:0], chunk_size=CHUNK_TOKENS
    )
    world = dist.get_world_size(layer.group)
    parts = [*earlier, own, *[empty] * (world - len(earlier) - 1)]
    out_b, lse_b = causal_partial(q_s, key_BKRD, value_BKRV)
    out_BHRV, _ = merge_partials([p[0] for p in parts] + [out_b], [p[1] for p in parts] + [lse_b])
    return out_BHRV.to(query_BHRD.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, wavefront_attention)


@contextlib.contextmanager
def _wavefront_installed(model: PreTrainedModel) -> Iterator[None]:
    """The attention function and the per-layer pause hooks, for the duration of the block."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    handles = [
        layer.register_forward_pre_hook(_pause_before_layer(i))
        for i, layer in enumerate(decoder_of(model).layers)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        config._attn_implementation = previous


class _Plan:
    """What every rank derives identically: which layer each rank runs at a step, message shapes."""

    def __init__(self, model: PreTrainedModel, state: ShardedPrefixState, start_shard: int) -> None:
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
        # Queries and partials travel in fp32 (the attention's compute dtype for fp32/bf16).
        self.query_dims = None if fa is None else (heads, fa.head_dim)
        self.partial_dims = None if fa is None else (heads, fa.value_head_dim + 1)
        self.device = model.device

    @property
    def num_steps(self) -> int:
        return self.num_layers + self.state.world_size - 1

    def layer_of(self, rank: int, step: int) -> int | None:
        layer = step - rank
        return layer if 0 <= layer < self.num_layers else None

    def buffer(self, shard: int, dims: tuple[int, int]) -> Tensor:
        start, end = self.state.bounds[shard]
        return torch.empty(1, dims[0], end - start, dims[1], device=self.device)


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
        # Later ranks' queries: (requester, shard, buffer), answered in `serve_ready`.
        self.requests: list[tuple[int, int, Tensor]] = []
        for other in range(rank + 1, state.world_size):
            if plan.layer_of(other, step) in plan.full_slot:
                stream = []
                for shard in plan.computed[other]:
                    q = plan.buffer(shard, plan.query_dims)
                    stream.append(((_QUERY, other, shard), self._recv(q, other, shard, _QUERY)))
                    self.requests.append((other, shard, q))
                self.arrivals.watch(stream)
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
        previous = None if rank == 0 else plan.layer_of(rank - 1, step)
        if previous in plan.linear_slot:
            # Layer `previous` of this rank's first shard starts from it at the next step.
            slot, last = plan.linear_slot[previous], state.shards[0] - 1
            for buffer, kind in (
                (state.conv[slot, 0], _CONV),
                (state.recurrent[slot, 0], _RECURRENT),
            ):
                self.linear_recvs.append(self._recv(buffer, rank - 1, last, kind))

    def _recv(self, buffer: Tensor, src: int, shard: int, kind: int):
        return dist.irecv(buffer, group=self.group, group_src=src, tag=shard * _KINDS + kind)

    def _send(self, tensor: Tensor, dst: int, shard: int, kind: int) -> None:
        COMM.add(tensor)
        work = dist.isend(tensor, group=self.group, group_dst=dst, tag=shard * _KINDS + kind)
        self.sends.append(work)

    def send_queries(self, shard: int, q_s: Tensor) -> None:
        for other in range(self.rank):
            self._send(q_s, other, shard, _QUERY)

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
        state, pending = self.plan.state, []
        for request in self.requests:
            requester, shard, q = request
            if (_QUERY, requester, shard) not in self.arrivals.arrived:
                pending.append(request)
                continue
            slot = self.plan.full_slot[self.plan.layer_of(requester, self.step)]
            out, lse = prefix_partial(
                q, state.keys[slot], state.values[slot], chunk_size=CHUNK_TOKENS
            )
            self._send(
                torch.cat([out, lse[..., None]], dim=-1).contiguous(), requester, shard, _PARTIAL
            )
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
        self._serve_until(lambda: not self.requests)

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
    if layer in plan.full_slot:
        in_attention: collections.deque[_ShardThread] = collections.deque()
        for thread in threads:
            # A: up to the attention call; the queries leave at once.
            kind, payload = thread.resume()
            assert kind == "attention", (kind, layer)
            expected = plan.buffer(thread.shard, plan.query_dims).shape
            if payload.shape != expected:
                raise RuntimeError(
                    f"queries of shape {tuple(payload.shape)}, expected {tuple(expected)}: this "
                    "family's attention is not supported by wavefront_prefill; use sharded_prefill"
                )
            messages.send_queries(thread.shard, payload)
            in_attention.append(thread)
            messages.serve_ready()
            while len(in_attention) >= window or (in_attention and thread is threads[-1]):
                # C: merge the earlier ranks' partials, finish the layer.
                oldest = in_attention.popleft()
                kind, _ = oldest.resume(messages.earlier_partials(oldest.shard))
                assert kind in ("layer", "done"), kind
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
    on_shard: Callable[[ShardedPrefixState, int], None] | None = None,
    resume: ShardedPrefixState | None = None,
    start_shard: int = 0,
    attention_window: int | None = None,
) -> ShardedPrefixState:
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
    if is_glm(model):
        raise NotImplementedError(
            "wavefront_prefill covers K/V and Gated DeltaNet layers; GLM-5's MLA + DSA layers "
            "prefill with the sequential schedule: use sharded_prefill"
        )
    state = prefill_target(
        model, prompt_ids, shard_tokens=shard_tokens, group=group, resume=resume,
        start_shard=start_shard,
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
        broadcast_final_linear_state(state, group)
    return state
