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
there), so a prefetch asks for one only when its span runs past that (`exact_pages`, `StateAsk`), and its hit query
plans the hit (`widen_stop_points`, `StateAsk.plan`):
- all the stored pages within the budget: no state read;
- else all of them, and the deepest state stored within the budget of their end, read into the staged slot
  (`read_planned_state` keys the transfer by that state's page, not the last); stock's commit, pointed at the node
  ending at the state's depth (split there, `TailReplayMambaComponent.commit_hicache_transfer`), puts it where the
  match finds it as an anchor in HiCache's host pool, and the hit replays from it: exact, every stored token reused;
- else, with no such state, the pages within the budget of the server's own anchor, if that leaves at most a
  budget's worth unread (exact);
- else all of them, approximate, as a local hit with no anchor in reach is.
A hit that reads no state drops the transfer before its slot is staged (`drop_unneeded_state`).

Under TP (attention TP > 1) every rank has its own store objects (per-rank keys, per-rank `file` evictors, states
written a step after their pages), so the ranks' stores legitimately differ. SGLang's ranks agree on the hit's
length, but a plan made from one rank's store could read another state, or drop the state transfer, where a peer
does not: trees that diverge and collectives that pair wrongly (multi-server review F1). So the ranks first agree
on the plan's inputs, the pages stored and which of them have a state, with one MIN over SGLang's prefetch sync
groups (`agree_on_plan`), and every rank plans from the same inputs.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

STATE_ASK = "tail_replay_state_ask"  # a `StateAsk` on a prefetch's MAMBA transfer: what its hit query needs
STATE_PLAN = "tail_replay_state_plan"  # a `StatePlan`, set on the transfer by the hit query


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

    def plan(self, stored: int, with_state: set[int]) -> tuple[int, int | None]:
        """(the page the hit ends at, the page whose state it reads or None), of the `stored` pages the store has
        (KV and hidden rows) from the span's start and the pages `with_state` whose state it has."""
        if stored <= self.free_pages:
            return stored, None
        reach = self.budget(self.start + stored * self.page_size)
        state = max((p for p in with_state if p <= stored), default=None)
        if state is not None and (stored - state) * self.page_size <= reach:
            return stored, state
        if (stored - self.free_pages) * self.page_size <= reach:
            return self.free_pages, None
        return stored, None

    def depth(self, page: int) -> int:
        return self.start + page * self.page_size


@dataclass
class StatePlan:
    """What the hit query planned (on the transfer): where the hit ends, and the state it reads."""

    end: int
    state: int | None
    with_state: set[int]
    stored: int  # pages of the span this rank's store has (KV and hidden rows), before the ranks agree
    hash_values: list[str]  # the span's page hashes
    depth: int | None = None  # the state's depth in the tree, once the hit is agreed on


def ask_for_state(transfer, ask: StateAsk):
    """Mark stock's prefetch transfer of the trailing state as Tail-Replay's."""
    setattr(transfer, STATE_ASK, ask)
    return transfer


def state_depth(transfer) -> int | None:
    """The tree depth of the state a prefetch's transfer read (None: not Tail-Replay's, or it read the last page's,
    as stock's does)."""
    plan = getattr(transfer, STATE_PLAN, None)
    return None if plan is None else plan.depth


def _state_transfer(operation):
    return next((t for t in operation.pool_transfers or () if hasattr(t, STATE_ASK)), None)


def widen_stop_points(original, controller, operation):
    """Around `HybridCacheController._storage_hit_query` (the prefetch thread): the backend's stop points are the
    pages whose state is stored (and whose KV and hidden pages are, up to them); the hit `StateAsk.plan` chose is
    made the only deepest one, which `_sync_prefetch_hit_query` then agrees on over ranks."""
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
    with_state = {p for p in result.restorable_prefix_pages if p <= stored}
    end, state = getattr(transfer, STATE_ASK).plan(stored, with_state) if stored else (0, None)
    setattr(transfer, STATE_PLAN, StatePlan(end, state, with_state, stored, list(operation.all_hash_values)))
    result.restorable_prefix_pages = sorted(with_state.union(range(1, end + 1)))
    return operation.all_hash_values[:stored], stored * controller.page_size


def agree_on_plan(controller, operation, transfer, storage_hit_count: int) -> int:
    """Every rank of the prefetch's sync groups plans from the same inputs: the pages all of them have stored (up to
    the hit each would take after its own caps: host room, threshold, a failed query, 0) and those of them whose
    state all of them have. One MIN of a tensor shaped by the request's span, the same on every rank whether its
    query ran or not, as SGLang's own `_sync_prefetch_hit_query`. Returns this rank's hit count for that sync."""
    page = controller.page_size
    span = len(operation.token_ids) // page
    plan = getattr(transfer, STATE_PLAN, None)
    local = torch.zeros(span + 1, dtype=torch.int)
    if plan is not None:
        local[0] = min(plan.stored, storage_hit_count // page)
        local[[p for p in plan.with_state if p <= span]] = 1
    controller._all_reduce(local, torch.distributed.ReduceOp.MIN, controller.prefetch_hits_sync_groups)
    if plan is None:
        return storage_hit_count
    stored = int(local[0])
    plan.with_state = {p for p in range(1, stored + 1) if local[p]}
    plan.end, plan.state = getattr(transfer, STATE_ASK).plan(stored, plan.with_state) if stored else (0, None)
    operation.pool_storage_result.restorable_prefix_pages = sorted(plan.with_state.union(range(1, plan.end + 1)))
    return min(storage_hit_count, stored * page)


def drop_unneeded_state(original, controller, operation, storage_hit_count: int) -> int:
    """Around `_sync_prefetch_hit_query`: once the ranks agree on the plan's inputs (`agree_on_plan`), the hit agreed
    on reads the planned state (a rank may have cut it shorter: then the state at its last page, if stored); a hit
    that reads none drops the state transfer before any host slot is staged for it."""
    transfer = _state_transfer(operation)
    if transfer is not None:
        storage_hit_count = agree_on_plan(controller, operation, transfer, storage_hit_count)
    hit = original(controller, operation, storage_hit_count)
    plan = getattr(transfer, STATE_PLAN, None)
    if plan is None:
        return hit
    pages = hit // controller.page_size
    state = plan.state if pages == plan.end else (pages if pages in plan.with_state else None)
    if state is None:
        operation.pool_transfers.remove(transfer)
        transfer.keys = []  # no staging: `_alloc_prefetch_aux_staging` sizes it by its keys
    else:
        plan.depth = getattr(transfer, STATE_ASK).depth(state)
        plan.state = state
    return hit


def read_planned_state(original, controller, pool_transfers, all_hashes, kv_hit_pages) -> None:
    """Around `_sync_trailing_keys`, just before the read: SGLang keys a state transfer by the hit's last page; the
    planned state may lie before it."""
    original(controller, pool_transfers, all_hashes, kv_hit_pages)
    for transfer in pool_transfers:
        plan = getattr(transfer, STATE_PLAN, None)
        if plan is not None and plan.state is not None:
            transfer.keys = [plan.hash_values[plan.state - 1]]
