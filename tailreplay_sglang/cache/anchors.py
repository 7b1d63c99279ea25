"""Interval anchors: the recurrent state every N tokens of a prefill (`--tail-replay-anchor-interval N`), kept in
the radix tree like the ones SGLang keeps where a request or a prefill chunk ends.

The states come from inside the chunked GDN prefill, which computes the state at every 64-token chunk boundary
anyway: before a prefill forward, each exact request gets a mamba slot per anchor at extend start + N, + 2N, ...
(short of the extend's end, which the chunk-end anchor covers), and the CPU prefill ops write the conv and SSM state
there into that slot, layer by layer: `IntervalAnchors.plan` makes the plan (`by_slot`), and the runtime's hooks on
SGLang's two CPU prefill call sites hand it to the ops (`lifecycle.write_anchor_states`). Prefill chunks keep their
size.
A hit that replayed also keeps the state it rebuilt, at its match end (offset 0 of its extend): together with the
anchor it replayed from (within the budget) and the ones every N tokens after it, every point of its path has an
anchor at most max(budget, N) tokens back, and the next request branching at the same point replays nothing.
Once SGLang has put the request's KV into the tree (`checkpoint_into_tree`), each anchor is inserted at its depth,
splitting the node there; an anchor the tree cannot take (a state already there, the request not inserted) is freed.

Only on the torch GDN path (CPU without sgl-kernel): the GPU chunk kernels form the same per-chunk states, but
nothing here reads them yet, so on a GPU only the request-end and chunk-end anchors are kept.
"""

import torch

ATTR = "tail_replay_interval_anchors"  # on a Req: [(depth, mamba slot)] taken in its last prefill forward


def capture_available() -> bool:
    """Whether SGLang's GDN prefill runs on this package's torch ops (the CPU fallback), the ones that take
    checkpoints."""
    from tailreplay_sglang.cpu import fallback

    try:
        import sgl_kernel.mamba  # noqa: F401  (served by the fallback where the real package is missing)
    except ImportError:
        return False
    return fallback.is_active("sgl_kernel.mamba")


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
    and asserts that it gets one; anchors planned before it must leave that slot, or the scheduler dies (measured:
    a 3-slot pool, two 5000-token prompts, 1024-token chunks)."""
    return pool.mamba_allocator.available_size() + tree_cache.mamba_evictable_size() - len(reqs)


class IntervalAnchors:
    def __init__(self, interval: int):
        self.interval = interval
        # {physical slot of a request: [(offset, physical anchor slot)]} for the prefill forward being run
        self.by_slot: dict[int, list[tuple[int, int]]] = {}

    def plan(self, reqs, pool, tree_cache, is_exact, replayed_hits) -> None:
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
        for req, cuts in wanted:
            prefix = req.prefix_len
            slots = pool.mamba_allocator.alloc(len(cuts))
            if slots is None:
                continue
            setattr(req, ATTR, [(prefix + off, slot.view(1)) for off, slot in zip(cuts, slots)])
            physical = pool.translate_mamba_indices(slots)
            source = int(pool.translate_mamba_indices(req.kv.mamba_pool_idx.view(1))[0])
            by_slot[source] = [(off, int(dst)) for off, dst in zip(cuts, physical)]
        self.by_slot = by_slot

    def commit(self, cache, req) -> None:
        """After SGLang inserted [0, cache_protected_len) of the request: insert each anchor within it at its depth;
        free the ones the tree does not take."""
        anchors = getattr(req, ATTR, None)
        if not anchors:
            return
        setattr(req, ATTR, None)
        inserted = req.kv.cache_protected_len if req.kv.req_pool_idx is not None else 0
        for depth, slot in anchors:
            if depth > inserted or not insert_state_at_depth(cache, req, depth, slot):
                cache.req_to_token_pool.mamba_allocator.free(slot)

    @staticmethod
    def drop(pool, req) -> None:
        """Free the slots of anchors still pending on a request (released, or never inserted)."""
        anchors = getattr(req, ATTR, None)
        if anchors:
            setattr(req, ATTR, None)
            for _, slot in anchors:
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
    return not result.mamba_exist
