"""Anchors in HiCache's storage tier, without a server (`tailreplay_sglang/cache/storage_anchors.py`): which pages
of a fetch replay exactly from the server's own anchor, how a storage hit is planned, and the three hooks on SGLang's
prefetch thread, driven with SGLang's own transfer and result types and a hit query that judges pools the way
the `file` and Mooncake backends do (in order, stopping once no stop point is left). The servers' side is
tests/test_mooncake_store.py."""

import random
import threading
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult
from tailreplay_sglang.cache.storage_anchors import (STATE_ASK, StateAsk, drop_unneeded_state, exact_pages,
                                                     read_planned_state, state_depth, widen_stop_points)
from tailreplay_sglang.config import TailReplayConfig

CONFIGS = [TailReplayConfig(), TailReplayConfig(exact_budget=100), TailReplayConfig(anchor_interval=0),
           TailReplayConfig(ratio=0.5, min_tokens=8, anchor_interval=64), TailReplayConfig(mode="full")]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.mode}-{c.ratio}-{c.exact_budget}-{c.anchor_interval}")
def test_exact_pages_is_the_prefix_a_scan_finds(config):
    rng = random.Random(0)
    for _ in range(300):
        page = rng.choice([1, 16, 64])
        anchor = rng.randrange(0, 2000)
        start = anchor + rng.randrange(0, 1500) // page * page
        span = rng.randrange(0, 3000 // page)
        scan = 0
        while scan < span and start + (scan + 1) * page - anchor <= config.budget(start + (scan + 1) * page):
            scan += 1
        assert exact_pages(config, anchor, start, span, page) == scan


def ask(free: int, budget: int = 512, start: int = 0, page: int = 1) -> StateAsk:
    return StateAsk(free, start, page, lambda m: budget)


@pytest.mark.parametrize("stored, with_state, plan", [
    (450, set(), (450, None)),  # within the budget of the server's own anchor: all of it, no state
    (600, {512}, (600, 512)),  # past it: all of it, replayed from the stored state
    (650, {512, 640}, (650, 640)),  # the deepest one
    (600, set(), (512, None)),  # no state: cut back to the budget's end, exact from the server's anchor
    (2000, {512}, (2000, None)),  # no state within a budget of the end, and the cut would lose more: approximate
    (1100, {512, 1024}, (1100, 1024)),
    (900, {300}, (512, None)),  # the state is too far back, the budget's end is not: cut back there
])
def test_a_hit_reads_the_deepest_state_within_a_budget_of_its_end(stored, with_state, plan):
    assert ask(512).plan(stored, with_state) == plan


def hit_query(kv: int, hidden: int, states: set[int]):
    """SGLang's `_storage_hit_query` over a backend holding `kv` KV pages, `hidden` hidden pages and the states of
    `states`: pools judged in order, none once no stop point is left (`file` and Mooncake's batch_exists_v2)."""
    have = {PoolName.INDEXER: set(range(1, hidden + 1)), PoolName.MAMBA: states}

    def original(controller, operation):
        restorable, found = list(range(1, kv + 1)), {PoolName.KV: kv} if kv else {}
        for transfer in operation.pool_transfers:
            if not restorable:
                break
            pages = have[transfer.name]
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                pages = set(range(1, next((p for p in range(1, kv + 1) if p not in pages), kv + 1)))
            if pages & set(restorable):
                found[transfer.name] = max(pages & set(restorable))
            restorable = [p for p in restorable if p in pages]
        operation.pool_storage_result = PoolTransferResult(restorable[-1] if restorable else 0, found, restorable)
        operation.query_pool_hit_pages = found
        return operation.all_hash_values[:len(restorable) and restorable[-1]], (restorable[-1] if restorable else 0)

    return original


def prefetch(free: int, start: int = 0):
    state = PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    setattr(state, STATE_ASK, StateAsk(free, start, 1, lambda m: 512))
    hidden = PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)
    return state, SimpleNamespace(pool_transfers=[state, hidden], all_hash_values=[f"h{i}" for i in range(1, 1001)],
                                  token_ids=list(range(1000)))


def deepest(controller, operation, storage_hit_count):
    """SGLang's `_sync_prefetch_hit_query` on one rank: the deepest stop point within the count."""
    pages = [p for p in operation.pool_storage_result.restorable_prefix_pages if p <= storage_hit_count]
    return max(pages, default=0)


def trailing(controller, transfers, all_hashes, kv_hit_pages):
    """SGLang's `_sync_trailing_keys` for one state: the hit's last page."""
    for transfer in transfers:
        transfer.keys = all_hashes[kv_hit_pages - 1:kv_hit_pages]


CONTROLLER = SimpleNamespace(page_size=1, _all_reduce=lambda tensor, op, groups: None, prefetch_hits_sync_groups=[])


@pytest.mark.parametrize("kv, hidden, states, end, state", [
    (600, 600, {512}, 600, 512),
    (600, 600, set(), 512, None),  # stock's rule alone: no hit at all
    (600, 450, {512}, 450, None),  # the hidden rows stop first: within the budget, no state needed
    (450, 450, set(), 450, None),
    (700, 700, {512, 640}, 700, 640),
    (650, 650, {650}, 650, 650),  # a state at the last page: stock's own case
    (0, 0, set(), 0, None),
])
def test_the_prefetch_takes_every_stored_page_and_reads_the_state_it_replays_from(kv, hidden, states, end, state):
    transfer, operation = prefetch(free=512, start=100)
    hashes, stored = widen_stop_points(hit_query(kv, hidden, states), CONTROLLER, operation)
    assert stored == min(kv, hidden) and hashes == operation.all_hash_values[:stored]
    assert operation.pool_transfers[-1] is transfer  # judged last, so the hidden pages' verdict is there
    hit = drop_unneeded_state(deepest, CONTROLLER, operation, stored)
    assert hit == end
    assert (transfer in operation.pool_transfers) is (state is not None)
    if state is None:
        assert transfer.keys == [] and state_depth(transfer) is None  # no host slot staged, nothing to commit
        return
    read_planned_state(trailing, CONTROLLER, [transfer], operation.all_hash_values[:hit], hit)
    assert transfer.keys == [f"h{state}"] and state_depth(transfer) == 100 + state


def test_a_rank_that_cut_the_hit_shorter_reads_the_state_at_its_end_if_stored():
    transfer, operation = prefetch(free=512)
    widen_stop_points(hit_query(700, 700, {512, 600, 640}), CONTROLLER, operation)
    assert drop_unneeded_state(lambda *_: 600, CONTROLLER, operation, 700) == 600
    read_planned_state(trailing, CONTROLLER, [transfer], operation.all_hash_values[:600], 600)
    assert transfer.keys == ["h600"] and state_depth(transfer) == 600


def test_a_prefetch_without_tail_replays_state_transfer_is_left_as_it_is():
    hidden = PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)
    operation = SimpleNamespace(pool_transfers=[hidden], all_hash_values=[f"h{i}" for i in range(1, 1001)],
                                token_ids=list(range(1000)))
    assert widen_stop_points(hit_query(600, 600, set()), CONTROLLER, operation)[1] == 600
    assert operation.pool_storage_result.restorable_prefix_pages == list(range(1, 601))
    assert drop_unneeded_state(deepest, CONTROLLER, operation, 600) == 600 and operation.pool_transfers == [hidden]


def test_a_hit_folded_to_its_anchor_is_not_queried_again():
    """SGLang re-queries storage when the match at admission is shorter than the one its lookup saw; a fold shortens
    it by design (the lookup matches without planning the hit). `keep_folded_match` takes the folded match as the
    one seen; a match shorter for another reason (evicted KV) is still re-queried."""
    from tailreplay_sglang.cache.hierarchy import keep_folded_match
    from tailreplay_sglang.cache.request import state_of

    calls = []

    def original(scheduler, req):
        calls.append(req.rid)
        return True

    def req(rid, folded_from, seen=3619, prefix=3584):
        r = SimpleNamespace(rid=rid, storage_prefetch_last_match_len=seen, prefix_len=prefix, host_hit_length=0)
        state_of(r).folded_from = folded_from
        return r

    folded, evicted, unfolded = req("folded", 3619), req("evicted", 3619, seen=4000), req("unfolded", None)
    assert keep_folded_match(original, None, folded) is False and folded.storage_prefetch_last_match_len == 3584
    assert keep_folded_match(original, None, evicted) is True  # it lost KV beyond what the fold explains
    assert keep_folded_match(original, None, unfolded) is True and calls == ["evicted", "unfolded"]


class _TwoRanks:
    """Two TP ranks on threads, whose `_all_reduce` is a MIN over both (SGLang's prefetch sync groups)."""

    def __init__(self):
        self.barrier, self.seen = threading.Barrier(2, timeout=10), [None, None]

    def controller(self, rank: int):
        def all_reduce(tensor, op, groups):
            assert op == torch.distributed.ReduceOp.MIN and groups
            self.seen[rank] = tensor.clone()
            self.barrier.wait()
            torch.minimum(self.seen[0], self.seen[1], out=tensor)
            self.barrier.wait()
        return SimpleNamespace(page_size=1, _all_reduce=all_reduce, prefetch_hits_sync_groups=["tp"])


@pytest.mark.parametrize("stores", [
    ((700, {512, 640}), (700, {512})),  # rank 1's state at 640 evicted by its own file LRU, or not written yet
    ((700, {512}), (650, {512})),  # rank 1 holds 50 pages fewer: stock's agreement alone makes rank 0 drop the state
    ((700, {640}), (700, set())),  # only rank 0 has a state: neither reads one
])
def test_tp_ranks_with_different_stores_plan_the_same_hit(stores):
    """Multi-server review F1: each TP rank's store is its own, yet every rank must commit the same state at the same
    depth (or none), or their trees diverge and their collectives pair wrongly. Driven through SGLang's own
    `_sync_prefetch_hit_query` on two ranks."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    ranks, outcome = _TwoRanks(), [None, None]

    def rank(i):
        (kv, states), controller = stores[i], ranks.controller(i)
        transfer, operation = prefetch(free=512)
        _, stored = widen_stop_points(hit_query(kv, kv, states), controller, operation)
        hit = drop_unneeded_state(HybridCacheController._sync_prefetch_hit_query, controller, operation, stored)
        outcome[i] = (hit, transfer in operation.pool_transfers, state_depth(transfer))

    threads = [threading.Thread(target=rank, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert outcome[0] is not None and outcome[0] == outcome[1], outcome


@pytest.mark.parametrize("page, start", [(16, 0), (16, 128), (64, 256)])
def test_page_arithmetic_at_page_sizes_above_one(page, start):
    """Issue 65 class 2: at page size 1 a page is a token and no page arithmetic can go wrong. 704 tokens stored past
    `start` with states stored at 512 and 640 tokens into the span, driven through SGLang's own single-rank
    `_sync_prefetch_hit_query`: the hit takes every stored page and reads the state at 640, keyed by its own page and
    committed at its own depth."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    controller = SimpleNamespace(page_size=page, _all_reduce=lambda tensor, op, groups: None,
                                 prefetch_hits_sync_groups=[])
    state = PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    setattr(state, STATE_ASK, StateAsk(512 // page, start, page, lambda m: 512))
    hidden = PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)
    operation = SimpleNamespace(pool_transfers=[state, hidden], all_hash_values=[f"h{i}" for i in range(1, 64)],
                                token_ids=list(range(63 * page)))
    stored_pages = 704 // page
    _, stored = widen_stop_points(hit_query(stored_pages, stored_pages, {512 // page, 640 // page}), controller,
                                  operation)
    assert stored == 704
    hit = drop_unneeded_state(HybridCacheController._sync_prefetch_hit_query, controller, operation, stored)
    assert hit == 704 and state in operation.pool_transfers
    read_planned_state(trailing, controller, [state], operation.all_hash_values[:hit // page], hit // page)
    assert state.keys == [f"h{640 // page}"] and state_depth(state) == start + 640
