"""Radix-cache backend `tail_replay`: SGLang's UnifiedRadixCache with FA KV at every token and recurrent states
(anchors) only where an exact one came free.

The MAMBA component is replaced by one for which every node with KV is a valid match end, so a hit is usable at
any token boundary (SGLang's own cap of input_len - 1 stays). On a hit of m tokens it looks up the deepest node on
the matched path that holds a state, the anchor at depth c:
- m - c within the exact budget: the request gets its own slot holding a copy of the anchor's state and replays
  [c, m) from it (exact); a span of at most `--tail-replay-fold-tokens` is not replayed: the match stops at c and
  the extend computes it, as after a stock hit on that state (one pass instead of a replay pass and an extend);
- otherwise (or with no anchor) a fresh, cleared slot and the paper's zero-init tail (approximate).
Requests whose state is exact donate it to the tree as stock no_buffer does (where they end, where each prefill
chunk ends); interval anchors are added by `cache/anchors.py`. An approximate state is never stored. States are
evicted by SGLang's mamba LRU; evicting one keeps the node's KV, which still hits through the zero-init tail, and
with `--tail-replay-host-anchors` moves the state to host memory, from where a hit copies it back
(`cache/host_anchors.py`). With an exact budget of 0 no node ever holds a state: the paper's pure mode.

Exactness is tracked on the KV too: the tokens an approximate request inserts past its match were computed from an
approximate state, so the node created for them is tainted (`TAINT_ATTR`, kept by both halves of a split). A hit
whose path has a tainted node is approximate whatever its anchor, and so is a request whose row SGLang re-pointed
at tainted nodes when it de-duplicated the request's insert (a retry racing its original): from then on its own
states are not exact, and it donates none.
"""

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch

from sglang.srt.mem_cache.registry import create_unified_radix_cache
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import (
    CacheTransferPhase,
    EvictLayer,
    LRURefreshPhase,
    PrepareLoadBackResult,
    PreparePrefetchResult,
)
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

from tailreplay_sglang.cache import storage_anchors
from tailreplay_sglang.cache.anchors import insert_state_at_depth
from tailreplay_sglang.cache.hierarchy import TailReplayRadixCache
from tailreplay_sglang.cache.request import (
    STATE_DEPTH_ATTR,
    TAINT_ATTR,
    Match,
    is_exact,
    is_tainted,
    peek,
    relabel,
    state_of,
)
from tailreplay_sglang.layout import SUPPORTED

RADIX_CACHE_BACKEND = "tail_replay"  # the name this backend is registered under (--radix-cache-backend)


class TaintedKVComponent(MambaComponent):
    """What Tail-Replay's MAMBA components share (this one, and the PD decode server's in `decode_component.py`):
    the runtime, no branching point of stock's own state grid, and the taint of the KV an approximate request
    inserts (`TAINT_ATTR` on its InsertParams marks the new leaf; both halves of a split keep it). SGLang builds
    components as `cls(cache, params)`; the backend factory binds our runtime first."""

    def __init__(self, cache, params, runtime):
        super().__init__(cache, params)
        self.runtime = runtime

    def finalize_match_result_in_tree_core(self, result, params, value_chunks, best_value_len):
        return result._replace(mamba_branching_seqlen=None)

    def commit_insert_component_data(self, node, is_new_leaf, params, result, cache_actions):
        if is_new_leaf and getattr(params, TAINT_ATTR, False):
            setattr(node, TAINT_ATTR, True)  # the new leaf is the KV this request computed past what was cached
        if params.mamba_value is not None:
            super().commit_insert_component_data(node, is_new_leaf, params, result, cache_actions)

    def redistribute_on_node_split(self, new_parent, child):
        super().redistribute_on_node_split(new_parent, child)
        setattr(new_parent, TAINT_ATTR, getattr(child, TAINT_ATTR, False))  # both halves come from one insert


def with_mamba_component(ctx, component) -> None:
    """Have SGLang's unified radix cache build `component` (bound to its runtime) as its MAMBA component."""
    ctx.params.component_registry_override = {
        **(ctx.params.component_registry_override or {}), ComponentType.MAMBA: component}


class TailReplayMambaComponent(TaintedKVComponent):
    def create_match_validator(self, match_device_only: bool = False):
        return lambda node: True  # states are rebuilt, so any node with KV (FULL's validator) ends a match

    def refresh_lru(self, phase, node, root_node):
        # Stock refreshes the match end's state; ours is the anchor above it (or none), so used anchors stay warm.
        if phase == LRURefreshPhase.MATCH_END:
            anchor, _ = self.deepest_anchor(node, 0, on_host=False)
            if anchor is not None:
                self.tree_core.lru_lists[self.component_type].reset_node_mru(anchor)

    def deepest_anchor(self, node, depth: int, on_host: bool = True):
        """(node, depth) of the deepest node holding a state on the path ending at `node` (at `depth`), in the
        device pool or (`on_host`) on the host: HiCache's host mamba pool, where a node's state goes with its KV,
        or the plugin's host anchors. (None, 0) if there is none; no anchor is ever used with an exact budget of 0."""
        if not self.runtime.config.anchored:
            return None, 0
        ct, host = self.component_type, self.runtime.host_anchors if on_host else None
        if host is not None:
            host.follow_tree(self.tree_core.root_node)
        while node is not None and node is not self.tree_core.root_node:
            data = node.component_data[ct]
            if data.value is not None or (on_host and data.host_value is not None) or (
                    host is not None and node in host):
                return node, depth
            depth -= len(node.key)
            node = node.parent
        return None, 0

    def finalize_match_result_in_cache(self, params, result):
        req = params.req
        # A request that already holds a slot (chunked prefill, checkpoint re-match) keeps its live state.
        if not params.cow_mamba or req is None or req.kv.holds_mamba:
            return result
        # Under HiCache the match runs on through nodes whose KV (and hiddens) are on the host: the scheduler loads
        # them back before the extend (all or none; `TailReplayRadixCache.init_load_back` re-plans on none).
        m = result.device_prefix_len + result.host_hit_length
        fold = self.plan_hit(req, self.tree_core.node_by_id(result.best_match_node), m)
        return result if fold is None else self._match_up_to(result, *fold)

    def plan_hit(self, req, end, m: int, may_fold: bool = True):
        """Decide how the request's state at m is rebuilt, stage the anchor it starts from and record the `Match`.
        Returns (anchor, depth) where the match is to stop at the anchor instead (the fold), else None.

        With no state on the path, the root's zero state is the anchor: replaying [0, m) from a cleared slot is
        exact too, and within the budget it is the cheapest exact start there is."""
        config = self.runtime.config
        anchor, c = self.deepest_anchor(end, m)
        clean = not is_tainted(end)  # else the KV and hiddens the hit reuses are approximate, whatever its state
        fold, folded_from = None, None
        if config.anchored and m - c <= config.budget(m):
            if anchor is not None:  # else SGLang gives the request a cleared slot at prepare_for_extend
                self._stage_anchor_state(req, anchor)
            if may_fold and m - c <= config.fold_tokens:  # cheaper in the extend than in a replay pass
                fold, folded_from, m = (anchor, c), m, c
                clean = not is_tainted(anchor)  # it now reuses the KV above the anchor only (None: the root)
            match = Match(m, c, exact=clean)
        else:  # SGLang gives the request a cleared slot at prepare_for_extend
            match = Match(m, None, exact=clean and config.is_exact_fallback(m))
        state = relabel(req, match.exact)  # later checkpoints of the request read `exact`
        state.match, state.folded_from = match, folded_from
        return fold

    def replan_after_load(self, req, node_id, m: int) -> None:
        """The load-back brought fewer host tokens than the match planned for (none: SGLang loads all or none, and
        skips loads under its threshold): plan again for the m tokens now on the device, in the slot the request
        already has. No fold: the scheduler has fixed the prefix."""
        state = peek(req)
        if state is None or state.match is None or state.match.matched == m:
            return
        self.runtime.staged_anchors.drop(self.cache, self.runtime.host_anchors, req)
        req.kv.mamba_cow_src_index = None
        req.kv.mamba_needs_clear = req.kv.mamba_pool_idx is not None
        self.plan_hit(req, self.tree_core.node_by_id(node_id), m, may_fold=False)

    def _match_up_to(self, result, anchor, depth: int):
        """The match cut back to the anchor's node (the root for depth 0): the extend computes the rest, as it does
        after a stock hit on that state, and no replay runs. An anchor on a host node keeps the load-back above it."""
        if anchor is not None and depth > result.device_prefix_len:
            return result._replace(host_hit_length=depth - result.device_prefix_len, last_host_node=anchor.id,
                                   best_match_node=anchor.id)
        node_id = (anchor or self.tree_core.root_node).id
        return result._replace(device_prefix_len=depth, host_hit_length=0, last_device_node=node_id,
                               last_host_node=node_id, best_match_node=node_id)

    def _stage_anchor_state(self, req, anchor) -> None:
        """The request's own slot, which the forward fills with the anchor's state (`anchor_copy`): the anchor is
        held first, since allocating the slot may evict; a device anchor becomes the slot's copy-on-write source."""
        staged, host = self.runtime.staged_anchors, self.runtime.host_anchors
        src = anchor.component_data[self.component_type].value
        if src is not None:
            staged.hold_device(self.cache, req, anchor)
        elif host is not None and anchor in host:
            staged.hold_host(host, req, anchor)
            self.runtime.count_host_anchor_hit()
        else:  # in HiCache's host mamba pool
            staged.hold_hicache(self.cache, req, anchor)
            self.runtime.count_hicache_anchor_hit()
        if req.kv.mamba_pool_idx is None:
            req.kv.mamba_pool_idx = self._alloc_mamba_slot()[0]
        req.kv.mamba_cow_src_index = src
        req.kv.mamba_needs_clear = False

    def prepare_for_caching_req(self, req, insert_params, token_ids_len, is_finished):
        if self.runtime.config.anchored and is_exact(req):
            cache_len = super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
            if not self.cache.enable_mamba_extra_buffer or cache_len == token_ids_len:
                return cache_len
            # extra_buffer keeps states only at track points, and stock caps the insert there, so a short turn would
            # insert no KV at all. Every token's KV goes in; the state becomes an anchor at its own depth (cleanup).
            setattr(insert_params, STATE_DEPTH_ATTR, (cache_len or 0, insert_params.mamba_value))
            insert_params.mamba_value = None
            return token_ids_len
        insert_params.mamba_value = None  # an approximate state is never an anchor
        setattr(insert_params, TAINT_ATTR, not is_exact(req))
        return token_ids_len

    def cleanup_after_caching_req(self, req, is_finished, insert_result=None, insert_params=None):
        if self.runtime.config.anchored and is_exact(req):
            insert_result = self._insert_tracked_state(req, insert_result, insert_params)
            super().cleanup_after_caching_req(req, is_finished, insert_result, insert_params)
            if not is_finished and is_tainted(self.tree_core.node_by_id(req.last_node)):
                state_of(req).exact = False  # its row now reads approximate KV (de-duplicated into the tree)
            return
        if is_finished and req.kv.holds_mamba:
            self.cache.req_to_token_pool.free_mamba_cache(req)

    def _insert_tracked_state(self, req, insert_result, insert_params):
        """extra_buffer: the track-point state `prepare_for_caching_req` held back goes into the tree at its depth,
        now that the request's KV is there. Returns the insert result SGLang's cleanup reads (`mamba_exist`: the
        state was not taken, so the slot is freed, as stock frees a state the tree already had)."""
        depth, value = getattr(insert_params, STATE_DEPTH_ATTR, (0, None)) if insert_params is not None else (0, None)
        if value is None:
            return insert_result
        setattr(insert_params, STATE_DEPTH_ATTR, None)
        insert_params.mamba_value = value
        inserted = insert_result is not None and 0 < depth <= req.kv.cache_protected_len
        taken = inserted and insert_state_at_depth(self.cache, req, depth, value)
        return _InsertOutcome(mamba_exist=not taken)

    # ---- HiCache (`cache/hierarchy.py`) ----

    def build_hicache_transfers(self, node, phase, **kwargs):
        """A node's anchor state goes to HiCache's host mamba pool with its KV, and from there to storage with the
        node's pages, as stock's does (an anchor added to a node already backed up follows through SGLang's
        incremental backup). A storage prefetch reads a state only past the exact budget (`storage_anchors`). No
        load-back brings a state back: a hit copies its anchor from the host itself (`anchor_copy`), whether or not
        it is its match end."""
        if phase in (CacheTransferPhase.BACKUP_HOST, CacheTransferPhase.BACKUP_STORAGE):
            return super().build_hicache_transfers(node, phase, **kwargs)
        if phase == CacheTransferPhase.PREFETCH and kwargs.get("staging_tokens"):
            transfers = super().build_hicache_transfers(node, phase, **kwargs)
            ask = self._state_ask(node, kwargs.get("prefetch_tokens", 0))
            return [storage_anchors.ask_for_state(transfer, ask) for transfer in transfers]
        return None

    def commit_hicache_transfer(self, node, phase, transfers=(), **kwargs):
        if phase != CacheTransferPhase.PREFETCH or not transfers:
            return super().commit_hicache_transfer(node, phase, transfers, **kwargs)
        if transfers[0].host_indices is None:
            return None  # the hit reads no state (`storage_anchors.drop_unneeded_state`): none was staged
        depth, inserted = storage_anchors.state_depth(transfers[0]), kwargs.get("insert_result")
        if depth is None or inserted is None or inserted.inserted_host_node is None:
            return super().commit_hicache_transfer(node, phase, transfers, **kwargs)
        # Stock puts the state on the hit's last node; the one read here may end before it: its node, split there.
        at_depth = self._host_node_at(self.tree_core.node_by_id(inserted.inserted_host_node), depth,
                                      kwargs["cache_actions"])
        pointed = dataclasses.replace(inserted, inserted_host_node=at_depth.id)
        super().commit_hicache_transfer(node, phase, transfers, **{**kwargs, "insert_result": pointed})
        inserted.mamba_exist = pointed.mamba_exist
        return None

    def _host_node_at(self, end, depth: int, cache_actions):
        """The node on the path ending at `end` that ends at `depth`, splitting the one that spans it."""
        node_end = self._depth_of(end)
        node = end
        while node_end - len(node.key) >= depth:
            node_end -= len(node.key)
            node = node.parent
        if node_end == depth:
            return node
        parent, action = self.tree_core._split_node(node.key, node, depth - (node_end - len(node.key)))
        if action is not None:
            cache_actions.append(action)
        return parent

    def _depth_of(self, node) -> int:
        depth = 0
        while node is not None and node is not self.tree_core.root_node:
            depth, node = depth + len(node.key), node.parent
        return depth

    def prepare_load_back(self, node_id, *, req=None):
        return PrepareLoadBackResult()  # the hit's slot was taken at the match

    def prepare_prefetch(self, node_id, *, prefetch_tokens: int = 0):
        """One state slot staged for a fetch that runs past the exact budget from the deepest anchor above it; none
        otherwise: then any token boundary of the fetched KV is an exact match end (stock stages one for every
        fetch and cuts it back to the pages it has a state for)."""
        ask = self._state_ask(self.tree_core.node_by_id(node_id), prefetch_tokens)
        if not self.cache.enable_storage or ask is None or ask.free_pages * ask.page_size >= prefetch_tokens:
            return PreparePrefetchResult()
        return PreparePrefetchResult(staging_tokens=1)

    def _state_ask(self, node, prefetch_tokens: int):
        """A fetch below `node`: which of its pages replay exactly from the deepest anchor above it (None: no anchor
        is ever used)."""
        config = self.runtime.config
        if not config.anchored:
            return None
        depth = self._depth_of(node)
        _, anchor_depth = self.deepest_anchor(node, depth)
        page = self.cache.page_size
        free = storage_anchors.exact_pages(config, anchor_depth, depth, prefetch_tokens // page, page)
        return storage_anchors.StateAsk(free, depth, page, config.budget)

    def recover_after_unevict(self, node, prefix_len, total_prefix_len, params, result, cache_actions):
        super().recover_after_unevict(node, prefix_len, total_prefix_len, params, result, cache_actions)
        if getattr(params, TAINT_ATTR, False):
            setattr(node, TAINT_ATTR, True)  # the node's KV on the device is now the approximate inserter's

    def discard_deleted_session_leaf(self, node) -> None:
        """Called for every node the tree deletes: its host state goes with it."""
        super().discard_deleted_session_leaf(node)
        if self.runtime.host_anchors is not None:
            self.runtime.host_anchors.discard(node)

    def evict_component(self, node, device_frees, host_frees, cache_actions, target=EvictLayer.DEVICE):
        data = node.component_data[self.component_type]
        if EvictLayer.DEVICE in target and data.value is not None:
            self.runtime.count_evicted_anchor()
            if data.host_value is None and EvictLayer.HOST not in target and self.cache.cache_controller is not None:
                self._backup_state_to_hicache(node)
        return super().evict_component(node, device_frees, host_frees, cache_actions, target)

    def _backup_state_to_hicache(self, node) -> None:
        """Under HiCache an anchor leaving the device goes to the host mamba pool, as a node's state does when its
        KV is backed up, if it has no host copy yet: an anchor added to a node whose write-through was still in
        flight (interval anchors, inserted right after their request's KV) gets none from SGLang. Copied now, on
        the forwards' stream; the stock eviction below then puts the node on the host LRU. With the host pool full
        the state goes (its KV still hits, from a shallower anchor)."""
        from sglang.srt.mem_cache.hicache_storage import PoolName

        group, data = self.cache.host_pool_group, node.component_data[self.component_type]
        host_value = group.alloc(1, pool=PoolName.MAMBA)
        if host_value is None:
            return
        entry, controller = group.get_entry(PoolName.MAMBA), self.cache.cache_controller
        # The index copy to the device goes on the stream of the kernel that reads it: from the scheduler's stream
        # it would race that kernel, and its block could be reused (by the eviction's own frees) before it ran.
        with on_forward_stream(self.runtime.forward_stream):
            keep_for_forward_stream(data.value, self.runtime.forward_stream)
            host_indices, device_indices = controller.move_indices(host_value, data.value.view(-1))
            entry.host_pool.backup_from_device_all_layer(entry.device_pool, host_indices, device_indices,
                                                         controller.io_backend)
            stored = torch.cuda.Event() if is_cuda_stream(self.runtime.forward_stream) else None
            if stored is not None:
                stored.record()  # the storage thread reads the host copy once this copy is done
        data.host_value = host_value.clone()
        self.runtime.count_hicache_anchor_backup()
        self.cache.write_state_to_storage(node, stored)

    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        """One step of the mamba LRU walk: tombstone the next unlocked anchor (`_next_victim`), leaf or not.

        Stock evicts a leaf whole when its state is chosen, KV included, because a stock hit needs the state. Here
        the KV still hits without it (zero-init tail), so only the state goes and the KV stays to FULL's LRU. With
        host anchors the state is copied to host memory first.
        """
        ct = self.component_type
        node = self._next_victim(self.tree_core.lru_lists[ct])
        if node is None or tracker[ct] >= self._evict_device_request_cnt:
            return None
        self._save_to_host(node)
        self.tree_core._evict_component_and_detach_lru(node, self, target=EvictLayer.DEVICE, tracker=tracker,
                                                       device_frees=device_frees, host_frees=host_frees,
                                                       cache_actions=cache_actions)
        return None

    def _next_victim(self, lru):
        """The least recently used unlocked anchor; under `--tail-replay-anchor-keep ends`, the least recently used
        one with exactly one child (neither a branch point, where paths fork, nor a path's end, where requests
        stopped and continue), if there is one."""
        node = lru.get_lru_no_lock()
        if self.runtime.config.anchor_keep == "lru":
            return node
        candidate = node
        while candidate is not None and len(candidate.children) != 1:
            candidate = lru.get_prev_no_lock(candidate)
        return candidate or node

    def _save_to_host(self, node) -> None:
        host = self.runtime.host_anchors
        if host is None:
            return
        host.follow_tree(self.tree_core.root_node)
        pool = self.cache.req_to_token_pool
        # the slot stays a device index, translated on the stream of the copy that reads it (as in N1)
        with on_forward_stream(self.runtime.forward_stream):
            value = node.component_data[self.component_type].value
            keep_for_forward_stream(value, self.runtime.forward_stream)
            slot = pool.translate_mamba_indices(value.view(-1)[:1])
            host.save(node, pool.mamba_pool, slot)


@dataclass(frozen=True)
class _InsertOutcome:
    """What SGLang's mamba cleanup reads of an insert result."""

    mamba_exist: bool


@contextlib.contextmanager
def on_forward_stream(stream):
    """Run the enclosed copies (host-anchor saves, made while scheduling) on the stream the forwards run on (CUDA;
    `runtime.forward_stream`, recorded by the last forward): under the overlap scheduler the next batch is scheduled
    while the previous one still runs, so a copy on the scheduler's stream could read a state that batch is still
    writing, or be overtaken by a later write to the freed slot. On the forwards' stream it runs after every batch
    already launched and before any launched later. Before the first forward, or on a CPU, a no-op (nothing to
    order: no anchor exists yet, or every op runs when it is called)."""
    if stream is None or not is_cuda_stream(stream):
        yield
        return
    with torch.cuda.stream(stream):
        yield


def keep_for_forward_stream(index: torch.Tensor, stream) -> None:
    """A device index that a copy queued on the forwards' stream reads must outlive that copy. The eviction frees a
    node's state index on the scheduler's stream right after (SGLang's `_free_values`), and after a decode-graph
    step that stream waits only for a marker near the graph's start, so the block could be reused and overwritten
    before the queued copy read it: another slot's state saved as exact (GPU path review A). `record_stream` makes
    the caching allocator keep the block until the forwards' stream has passed this point. A no-op off CUDA."""
    if is_cuda_stream(stream):  # then the index is a device tensor too
        index.record_stream(stream)


def is_cuda_stream(stream) -> bool:
    return isinstance(stream, torch.cuda.Stream)


def create_tail_replay_cache(runtime, ctx):
    """The backend factory SGLang's `create_tree_cache` calls (`hooks.py` binds `runtime`): its own unified radix
    cache (with HiCache's hooks, `hierarchy.py`) and our MAMBA component."""
    if not ctx.is_hybrid_ssm:
        raise ValueError(f"--enable-tail-replay needs a hybrid model with linear-attention layers. "
                         f"Supported: {SUPPORTED}")
    with_mamba_component(ctx, functools.partial(TailReplayMambaComponent, runtime=runtime))
    return create_unified_radix_cache(ctx, cache_class=functools.partial(TailReplayRadixCache, runtime=runtime))
