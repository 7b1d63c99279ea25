"""Anchors in HiCache's storage tier (L3: the `file` backend or Mooncake's store): recurrent states stored beside
the pages of the prefix they end, so that a server that never computed a prefix hits it exactly past the exact
budget, from the deepest state another server stored inside it.

Writes are stock's. A node's state goes to storage with the node's pages, keyed by the hash of its last page (the
MAMBA component's BACKUP_STORAGE transfer), once it has a host copy; the ack of the host backup that brings the copy
writes the node to storage. Anchors inserted after their request's KV (interval anchors, extra_buffer's track
state) split a node whose write-through was already issued, so SGLang never backs them up: they are backed up at
a later scheduler step, once no write-through is pending on the node (`TailReplayRadixCache.back_up_state`), and
one the device pool evicts first gets its host copy at the eviction and is written at the next step
(`write_state_to_storage`). The node's KV and hidden pages go again with the state, which the backends skip as
present. Tainted nodes are never written (`TailReplayRadixCache.write_backup_storage`).

Reads. Stock asks every storage prefetch for the state at the hit's last page (one staged host slot, SGLang's
trailing-page rule), and the hit stops at the deepest page whose state is stored: no state, no hit. Here a hit
needs no state within the exact budget of the deepest anchor the server holds above the fetch (it replays from
there), so a prefetch asks for one only when its span runs past that (`exact_pages`, `StateAsk`), and the hit query
then picks where the hit ends (`widen_stop_points`, `StateAsk.stop`):
- the whole stored span when it lies within the budget (no state read);
- else the deepest exact stop point, a page whose state is stored or the budget's end, when that leaves at most a
  budget's worth of stored pages unread: the state is read into the staged slot and lands on the hit's last node
  (stock's commit), where the match finds it as an anchor in HiCache's host pool (`deepest_anchor`), and the
  extend computes the rest;
- else the whole span, approximate, as a local hit with no anchor in reach is.
A hit that ends where no state is read drops the transfer before its slot is staged (`drop_unneeded_state`).

Left: a hit cut back to a stored state does not read the KV past it, which a replay from it could reuse; that needs
the state's slot keyed by a page other than the hit's last, which SGLang's trailing-page rule does not allow.
"""

from collections.abc import Callable
from dataclasses import dataclass

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

STATE_ASK = "tail_replay_state_ask"  # a `StateAsk` on a prefetch's MAMBA transfer: what its hit query needs
STORED = "tail_replay_stored_pages"  # set by the hit query: the span's pages whose state is stored


def exact_pages(config, anchor_depth: int, start: int, span_pages: int, page_size: int) -> int:
    """How many pages of a fetch starting at depth `start` end where a hit replays exactly from the anchor at
    `anchor_depth` (within `config.budget`). The excess m - anchor - budget(m) grows with m (the budget grows by
    at most the tail's ratio per token), so those pages are a prefix of the span: found by bisection."""
    lo, hi = 0, span_pages
    while lo < hi:
        mid = (lo + hi + 1) // 2
        m = start + mid * page_size
        if m - anchor_depth <= config.budget(m):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class StateAsk:
    """A fetch's request for a stored state, from the scheduler to its hit query (the prefetch thread)."""

    free_pages: int  # pages from the span's start whose hits replay exactly from the server's own anchor
    start: int  # the span's depth in the tree
    page_size: int
    budget: Callable[[int], int]  # `TailReplayConfig.budget`

    def stop(self, stored: int, with_state: set[int]) -> int:
        """The page the hit ends at, of the `stored` pages the store has (KV and hidden rows) from the span's
        start: all of them within the free pages; else the deepest exact stop point (a page with its state stored,
        or the last free page) if that leaves at most a budget's worth of them unread; else all of them, an
        approximate hit, as a local hit with no anchor in reach is."""
        if stored <= self.free_pages:
            return stored
        exact = max(self.free_pages, max(with_state, default=0))
        if (stored - exact) * self.page_size <= self.budget(self.start + stored * self.page_size):
            return exact
        return stored


def ask_for_state(transfer, ask: StateAsk):
    """Mark stock's prefetch transfer of the trailing state as Tail-Replay's."""
    setattr(transfer, STATE_ASK, ask)
    return transfer


def _state_transfer(operation):
    return next((t for t in operation.pool_transfers or () if hasattr(t, STATE_ASK)), None)


def widen_stop_points(original, controller, operation):
    """Around `HybridCacheController._storage_hit_query` (the prefetch thread): the backend's stop points are the
    pages whose state is stored (and whose KV and hidden pages are, up to them); this makes `StateAsk.stop` the
    deepest one, which `_sync_prefetch_hit_query` then agrees on over ranks."""
    transfer = _state_transfer(operation)
    if transfer is not None:  # last: the backends stop judging pools once no stop point is left
        operation.pool_transfers.remove(transfer)
        operation.pool_transfers.append(transfer)
    hash_value, hit = original(controller, operation)
    result = operation.pool_storage_result
    if transfer is None or result.restorable_prefix_pages is None:  # no query ran (a span known to be stored)
        return hash_value, hit
    found = operation.query_pool_hit_pages
    stored = found.get(PoolName.KV, 0)  # pages whose every part but the state is stored, from the span's start
    for other in operation.pool_transfers:
        if other is not transfer and other.hit_policy == PoolHitPolicy.ALL_PAGES:
            stored = min(stored, found.get(other.name, 0))
    ask = getattr(transfer, STATE_ASK)
    with_state = {p for p in result.restorable_prefix_pages if p <= stored}
    setattr(transfer, STORED, with_state)
    end = ask.stop(stored, with_state) if stored else 0
    points = with_state.union(range(1, min(ask.free_pages, stored) + 1), (stored,) if stored else ())
    result.restorable_prefix_pages = sorted(p for p in points if p <= end)
    return operation.all_hash_values[:stored], stored * controller.page_size


def drop_unneeded_state(original, controller, operation, storage_hit_count: int) -> int:
    """Around `_sync_prefetch_hit_query`: a hit that ends at a page with no stored state reads none (it needs none,
    or is approximate): the state transfer leaves the operation before any host slot is staged for it."""
    hit = original(controller, operation, storage_hit_count)
    transfer = _state_transfer(operation)
    if transfer is not None and hasattr(transfer, STORED) and hit // controller.page_size not in getattr(
            transfer, STORED):
        operation.pool_transfers.remove(transfer)
        transfer.keys = []  # no staging: `_alloc_prefetch_aux_staging` sizes it by its keys
    return hit
