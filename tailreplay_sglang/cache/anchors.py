"""Interval anchors: the recurrent state every N tokens of a prefill (`--tail-replay-anchor-interval N`), kept in
the radix tree like the ones SGLang keeps where a request or a prefill chunk ends.

The states come from what the chunked prefill computes anyway: the state entering every chunk. Before a prefill
forward, each exact request gets a mamba slot per anchor at extend start + N, + 2N, ... (short of the extend's end,
which the chunk-end anchor covers): `IntervalAnchors.plan` makes the plan (`by_slot`). During the forward the
family's hooks on SGLang's prefill call sites fill the slots, layer by layer (`families/`); the writers shared by the
families whose prefill returns the state entering every 64-token chunk of each sequence (`h`) are here: the conv
state at an offset is the width - 1 inputs before it, taken from the conv's own input before the conv runs
(`write_conv_states`); the SSM state is `h` at the offset's chunk, taken after the chunk kernel ran
(`write_ssm_states`). Each slot is marked written by both halves (`written`); only a written anchor is ever
inserted, so a prefill kernel that bypasses the hooks costs anchors, never correctness. Prefill chunks keep their
size.

A hit that replayed also keeps the state it rebuilt, at its match end (offset 0 of its extend), where the family's
prefill holds it (`Family.anchor_at_replay_end`): together with the anchor it replayed from (within the budget) and
the ones every N tokens after it, every point of its path has an anchor at most max(budget, N) tokens back, and the
next request branching at the same point replays nothing. Once SGLang has put the request's KV into the tree
(`checkpoint_into_tree`), each anchor is inserted at its depth, splitting the node there; an anchor the tree cannot
take (a state already there, the request not inserted, a depth off the page grid) is freed.
"""

import contextlib
import logging

import torch

from tailreplay_sglang.cache.request import is_exact, peek, state_of
from tailreplay_sglang.config import GDN_CHUNK  # the chunk of `h`: fla's chunk kernels and ops/gdn.CHUNK_SIZE

logger = logging.getLogger(__name__)


def offsets(extend_len: int, interval: int, at_start: bool = False) -> list[int]:
    """Offsets into an extend of `extend_len` tokens where an anchor is taken: every `interval` tokens short of the
    end, and at 0 (the replayed state of a hit) when `at_start`."""
    cuts = [0] if at_start else []
    if interval > 0:
        cuts += list(range(interval, extend_len, interval))
    return cuts


def spare_slots(reqs, pool, tree_cache) -> int:
    """Mamba slots anchors may take in this forward: free plus evictable, less one per request of the batch. After
    the forward SGLang copies each unfinished (chunked) request's state into a new slot (its chunk-end checkpoint)
    and asserts that it gets one; anchors planned before it must leave that slot, or the scheduler dies."""
    return pool.mamba_allocator.available_size() + tree_cache.mamba_evictable_size() - len(reqs)


class IntervalAnchors:
    def __init__(self, interval: int):
        self.interval = interval
        # {physical slot of a request: [(offset, physical anchor slot)]} for the prefill forward being run
        self.by_slot: dict[int, list[tuple[int, int]]] = {}
        # physical anchor slots whose conv / SSM state a hook wrote, until the anchor is inserted or freed
        self.written: dict[str, set[int]] = {"conv": set(), "ssm": set()}
        self.warned_unwritten = False
        self._layout: dict[str, list] = {}  # the batch layout the forward's hooks read (`layout`), once per forward

    def use_plan(self, by_slot: dict[int, list[tuple[int, int]]]) -> None:
        """The plan of the next prefill forward."""
        self.by_slot, self._layout = by_slot, {}

    def layout(self, name: str, tensor: torch.Tensor) -> list:
        """`tensor.tolist()` for the batch layout (sequence bounds, slots, ...), read once per planned forward: every
        layer's hook gets the same metadata, and each read of a device tensor is a host sync on a GPU."""
        if name not in self._layout:
            self._layout[name] = tensor.tolist()
        return self._layout[name]

    @contextlib.contextmanager
    def paused(self):
        """No anchor is written inside (the replay pass runs on the slots the plan is keyed by)."""
        by_slot, self.by_slot = self.by_slot, {}
        try:
            yield
        finally:
            self.by_slot = by_slot

    def write_conv_states(self, x, conv_states, cache_indices, query_start_loc, has_initial_state) -> None:
        """Before SGLang's prefill conv (x: its input, [dim, T] packed): each planned anchor's conv state, the
        width - 1 inputs before its offset (the sequence's own left context below that), into the anchor's slot.
        Reads only the inputs and the slots' states from before the conv updates them."""
        if not self.by_slot:
            return
        width_1 = conv_states.shape[-1]
        bounds, slots = self.layout("bounds", query_start_loc), self.layout("slots", cache_indices)
        initial = self.layout("initial", has_initial_state)
        for i, slot in enumerate(slots):
            for offset, dst in self.by_slot.get(slot, ()):
                start, end = bounds[i], bounds[i + 1]
                stop = min(end, start + offset)
                inputs = x[:, max(start, stop - width_1):stop]  # only the width - 1 inputs the state holds
                if inputs.shape[-1] < width_1:  # within width - 1 of the extend's start: the slot's state before it
                    left = conv_states[slot].to(x.dtype) if initial[i] else x.new_zeros(x.shape[0], width_1)
                    inputs = torch.cat([left, inputs], dim=-1)[:, -width_1:]
                conv_states[dst] = inputs.to(conv_states.dtype)
                self.written["conv"].add(dst)

    def write_ssm_states(self, h, ssm_states, cache_indices, cu_seqlens) -> None:
        """After SGLang's chunked prefill: each planned anchor's SSM state is `h` at its chunk (h: [1, NT, HV, V,
        K], the state entering each 64-token chunk of each sequence, sequences in order)."""
        if not self.by_slot:
            return
        if h is None:
            raise RuntimeError("Tail-Replay interval anchors need the chunked prefill's per-chunk states (h)")
        bounds, slots, first_chunk = self.layout("bounds", cu_seqlens), self.layout("slots", cache_indices), 0
        for i, slot in enumerate(slots):
            for offset, dst in self.by_slot.get(slot, ()):
                assert offset % GDN_CHUNK == 0, offset
                ssm_states[dst] = h[0, first_chunk + offset // GDN_CHUNK].to(ssm_states.dtype)
                self.written["ssm"].add(dst)
            first_chunk += -(-(bounds[i + 1] - bounds[i]) // GDN_CHUNK)

    def mark_written(self, slot: int) -> None:
        """Both halves of the anchor in this physical slot are written (a family that writes them together)."""
        for slots in self.written.values():
            slots.add(slot)

    def _take_written(self, physical: int) -> bool:
        """Whether both halves of the anchor in this slot were written; forgets the slot either way."""
        written = all(physical in slots for slots in self.written.values())
        for slots in self.written.values():
            slots.discard(physical)
        return written

    def plan(self, reqs, pool, tree_cache, replayed_hits) -> None:
        """Before a prefill forward (scheduler side): slots for the anchors of every exact request, and where the ops
        write them. Slots come from the pool, evicting the least recently used anchors if it is short, but never
        the ones this batch still needs (`spare_slots`): anchors that find no slot are skipped.
        `replayed_hits`: requests whose extend starts from a replayed state."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        by_slot, wanted = {}, []
        for req in reqs:
            self.drop(pool, req)  # taken in an earlier forward but never inserted (the request was not cached)
        budget = spare_slots(reqs, pool, tree_cache)
        for req in reqs:
            if is_exact(req) and req.kv.holds_mamba:
                cuts = offsets(req.extend_len, self.interval, at_start=req in replayed_hits)[:max(budget, 0)]
                budget -= len(cuts)
                if cuts:
                    wanted.append((req, cuts))
        short = sum(len(cuts) for _, cuts in wanted) - pool.mamba_allocator.available_size()
        if short > 0 and wanted:
            tree_cache.evict_for_alloc(EvictParams(num_tokens=0, mamba_num=short))
        taken = [(req, cuts, slots) for req, cuts in wanted
                 if (slots := pool.mamba_allocator.alloc(len(cuts))) is not None]
        if taken:
            # physical slot ids of every request's own slot and its anchors' in one read (a host sync on a GPU),
            # kept with each anchor so that its commit or drop reads nothing more
            ids = torch.cat([torch.cat([req.kv.mamba_pool_idx.view(1), slots]) for req, _, slots in taken])
            physical = iter(pool.translate_mamba_indices(ids).tolist())
            for req, cuts, slots in taken:
                source, anchors = next(physical), [next(physical) for _ in cuts]
                state_of(req).interval_anchors = [(req.prefix_len + off, slot.view(1), phys)
                                                  for off, slot, phys in zip(cuts, slots, anchors)]
                by_slot[source] = list(zip(cuts, anchors))
        self.use_plan(by_slot)

    def commit(self, cache, req) -> None:
        """After SGLang inserted [0, cache_protected_len) of the request: insert each anchor within it at its depth;
        free the ones the tree does not take."""
        state = peek(req)
        if state is None or not state.interval_anchors:
            return
        anchors, state.interval_anchors = state.interval_anchors, []
        pool = cache.req_to_token_pool
        inserted = req.kv.cache_protected_len if req.kv.req_pool_idx is not None else 0
        for depth, slot, physical in anchors:
            written = self._take_written(physical)
            if not written and not self.warned_unwritten:
                self.warned_unwritten = True
                logger.warning("Tail-Replay: interval anchors were planned but the prefill did not pass through the "
                               "hooked prefill kernels (another --linear-attn-prefill-backend than triton?): "
                               "they are dropped; only request-end, chunk-end and track anchors are kept")
            if not written or depth > inserted or not insert_state_at_depth(cache, req, depth, slot):
                pool.mamba_allocator.free(slot)

    def drop(self, pool, req) -> None:
        """Free the slots of anchors still pending on a request (released, or never inserted)."""
        state = peek(req)
        if state is None:
            return
        anchors, state.interval_anchors = state.interval_anchors, []
        for _, slot, physical in anchors:
            self._take_written(physical)
            pool.mamba_allocator.free(slot)


def insert_state_at_depth(cache, req, depth: int, slot) -> bool:
    """Insert the state in `slot` at `depth` of the request's path, whose KV is already in the tree (the request's
    row holds the tree's indices up to `cache_protected_len`, so nothing is freed as a duplicate). False if a state
    was already there, or if `depth` is not on a page boundary: the tree keys whole pages, and would put the state
    at the page start, where it is not the state (the caller frees the slot)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    if depth % cache.page_size:
        return False

    key = RadixKey(req.full_untruncated_fill_ids[:depth], req.extra_key, is_bigram=False, cache_salt=req.cache_salt)
    value = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :depth].to(torch.int64, copy=True)
    result = cache.insert(InsertParams(key=key, value=value, mamba_value=slot, prev_prefix_len=depth,
                                       inserted_len=depth, priority=req.priority or 0))
    if result.mamba_exist:
        return False
    cache.back_up_state(result.last_device_node)  # to the host and to storage, where those tiers are on
    return True
