"""Anchors in HiCache's storage tier, without a server (`tailreplay_sglang/cache/storage_anchors.py`): which pages
of a fetch replay exactly from the server's own anchor, where a storage hit ends, and the two hooks on SGLang's
prefetch thread, driven with SGLang's own transfer and result types and a hit query that judges pools the way
the `file` and Mooncake backends do (in order, stopping once no stop point is left). The servers' side is
tests/test_mooncake_store.py."""

import random
from types import SimpleNamespace

import pytest

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult
from tailreplay_sglang.cache.storage_anchors import (STATE_ASK, StateAsk, drop_unneeded_state, exact_pages,
                                                     widen_stop_points)
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


@pytest.mark.parametrize("stored, with_state, end", [
    (450, set(), 450),  # within the budget: all of it, no state
    (600, {512}, 512),  # past it: cut back to the stored state
    (650, {512, 640}, 640),  # the deepest one
    (600, set(), 512),  # no state inside: cut back to the budget's end, exact from the root
    (2000, {512}, 2000),  # the deepest exact point leaves more than a budget unread: all of it, approximate
    (1100, {512, 1024}, 1024),
])
def test_a_hit_ends_at_the_deepest_exact_point_a_budget_from_its_end(stored, with_state, end):
    assert ask(512).stop(stored, with_state) == end


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


def prefetch(free: int):
    state = PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    setattr(state, STATE_ASK, ask(free))
    hidden = PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)
    return state, SimpleNamespace(pool_transfers=[state, hidden], all_hash_values=[f"h{i}" for i in range(1, 1001)])


def deepest(controller, operation, storage_hit_count):
    """SGLang's `_sync_prefetch_hit_query` on one rank: the deepest stop point within the count."""
    pages = [p for p in operation.pool_storage_result.restorable_prefix_pages if p <= storage_hit_count]
    return max(pages, default=0)


CONTROLLER = SimpleNamespace(page_size=1)


@pytest.mark.parametrize("kv, hidden, states, end, reads_state", [
    (600, 600, {512}, 512, True),
    (600, 600, set(), 512, False),  # stock's rule alone: no hit at all
    (600, 450, {512}, 450, False),  # the hidden rows stop first: within the budget, no state needed
    (450, 450, set(), 450, False),
    (700, 700, {512, 640}, 640, True),
    (0, 0, set(), 0, False),
])
def test_the_prefetch_stops_where_it_replays_exactly_and_reads_a_state_only_there(kv, hidden, states, end,
                                                                                   reads_state):
    state, operation = prefetch(free=512)
    hashes, stored = widen_stop_points(hit_query(kv, hidden, states), CONTROLLER, operation)
    assert stored == min(kv, hidden) and hashes == operation.all_hash_values[:stored]
    assert operation.pool_transfers[-1] is state  # judged last, so the hidden pages' verdict is there
    hit = drop_unneeded_state(deepest, CONTROLLER, operation, stored)
    assert hit == end
    assert (state in operation.pool_transfers) is reads_state
    assert (state.keys == []) is not reads_state  # a dropped transfer stages no host slot


def test_a_prefetch_without_tail_replays_state_transfer_is_left_as_it_is():
    hidden = PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)
    operation = SimpleNamespace(pool_transfers=[hidden], all_hash_values=[f"h{i}" for i in range(1, 1001)])
    assert widen_stop_points(hit_query(600, 600, set()), CONTROLLER, operation)[1] == 600
    assert operation.pool_storage_result.restorable_prefix_pages == list(range(1, 601))
    assert drop_unneeded_state(deepest, CONTROLLER, operation, 600) == 600 and operation.pool_transfers == [hidden]
