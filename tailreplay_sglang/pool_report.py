"""A readback of every pool Tail-Replay touches, served in SGLang's `/server_info` (`internal_states[i]`).

Tests and the soak run read the pools themselves here, not the logs: after traffic has drained, every KV slot (and
with it every hidden-store entry, which is addressed by KV slot) is free or held by the radix tree, no tree node is
locked, every mamba slot is free or an anchor held by the tree, every request row is free, and no replay is left
pending.
"""

KEY = "tail_replay_pools"


def count_evicted_tokens(runtime, result, cache, *args, **kwargs):
    """AFTER hook on UnifiedRadixCache._evict: tokens the radix tree has evicted since start-up."""
    runtime.count_evicted_tokens(int(getattr(result, "num_tokens_evicted", 0) or 0))
    return result


def pool_report(scheduler, runtime) -> dict:
    store, pending, host = runtime.store, runtime.pending, runtime.host_anchors
    kv = scheduler.token_to_kv_pool_allocator
    rows = scheduler.req_to_token_pool
    tree = scheduler.tree_cache
    return {
        "kv_total": int(kv.size),
        "kv_free": int(kv.available_size()),
        "tree_evictable": int(tree.evictable_size()),
        "tree_protected": int(tree.protected_size()),  # tokens on paths of locked nodes
        "mamba_total": int(rows.mamba_pool.size),
        "mamba_free": int(rows.mamba_allocator.available_size()),
        "tree_mamba_slots": int(tree.all_mamba_values_flatten().numel()),  # anchors (none with budget 0)
        "req_rows_total": int(rows.size),
        "req_rows_free": len(rows.free_slots),
        "hidden_store_slots": 0 if store is None else int(store.token_ids.numel()),
        "hidden_tier": None if store is None else store.tier,
        "hidden_dtype": None if store is None else str(store.codec.dtype),
        "hidden_store_device_bytes": 0 if store is None else store.device_nbytes,
        # this rank's bytes per cached token, and its part of every row: [attention-TP rank, ranks sharing a row]
        "hidden_store_bytes_per_token": 0 if store is None else store.nbytes // int(store.token_ids.numel()),
        "hidden_store_shard": None if store is None else [store.shard.rank, store.shard.world],
        "pending_write_backs": 0 if store is None else store.pending_write_backs(),
        "pending_replays": len(pending),
        "evicted_tokens": runtime.evicted_tokens,
        "evicted_anchors": runtime.evicted_anchors,
        "hicache_anchor_backups": runtime.hicache_anchor_backups,  # anchors the plugin copied to HiCache's host pool
        "hicache_anchor_hits": runtime.hicache_anchor_hits,  # hits that started from a state in that pool
        "host_anchors_total": 0 if host is None else host.capacity,
        "host_anchors_used": 0 if host is None else len(host),
        "host_anchor_bytes": 0 if host is None else host.nbytes,
        "host_anchors_saved": 0 if host is None else host.saved,  # device anchors moved to the host pool
        "host_anchors_dropped": 0 if host is None else host.dropped,  # host states dropped by the host LRU
        "host_anchor_hits": 0 if host is None else host.restored,  # hits that started from a host state
        "host_anchor_copy_ms": 0.0 if host is None else round(host.copy_seconds * 1e3, 3),
        # holds that end within a scheduling step (anchor_copy): a leak shows as a count left on an idle server
        "host_anchor_pins": 0 if host is None else host.pins,
        "staged_anchors": len(runtime.staged_anchors),  # anchors held from a match until the batch and its forward
        "decode_reused_tokens": runtime.decode_reused_tokens,  # PD decode: KV its own tree gave (not transferred)
        "waiting_reqs": len(scheduler.waiting_queue),
        "running_reqs": len(scheduler.running_batch.reqs),
    }


def add_to_internal_state(runtime, result, controller, *args, **kwargs):
    """AFTER hook on SchedulerInternalStateController.get_internal_state."""
    result.internal_state[KEY] = pool_report(controller.scheduler, runtime)
    return result
