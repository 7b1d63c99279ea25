"""Tail-Replay on SGLang's memory hierarchy (`--enable-hierarchical-cache`): the radix cache's class, SGLang's own
`UnifiedRadixCache` with three changes.

- The hidden store travels with the KV. Its host twin (`store/hicache_pool.HiddenHostPool`) is registered as a
  KV-derived sidecar of SGLang's controller, so each node's hidden rows are copied with its KV pages, addressed by
  the same host and device slots: device to host on backup (write-through or write-back), host to device on a
  load-back (with the KV's first layer, so a replay waiting for that layer starts while the other layers' KV still
  loads: the paper's H2D overlap), and to and from storage (L3) as pages of their own.
- A match that runs on into host nodes is planned for the tokens the load-back is to bring (`component.py`).
  SGLang loads all of them or none (none: a load under its threshold, or no room), and on none the hit is planned
  again for what is on the device (`init_load_back`).
- Tainted KV (computed from an approximate state) is never written to storage, where it would lose its taint: a
  node's taint lives on the tree node, and storage keeps pages by prefix hash.

Anchor states go to HiCache's host mamba pool with their nodes (stock's backup of a node's state), and a hit copies
its anchor from there (`anchor_copy.restore_from_hicache`).
"""

import logging

from sglang.srt.mem_cache.hicache_storage import PoolName, SidecarPoolSpec
from sglang.srt.mem_cache.pool_host.group import PoolEntry
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from tailreplay_sglang.cache.request import is_tainted, peek
from tailreplay_sglang.store.hicache_pool import HiddenHostPool

logger = logging.getLogger(__name__)

# SGLang's pool names are a closed enum. INDEXER is the KV-derived sidecar slot only sparse-attention models fill
# (their indexer keys); no hybrid model Tail-Replay supports has one, so the hidden store takes it.
HIDDEN_POOL = PoolName.INDEXER


class TailReplayRadixCache(UnifiedRadixCache):
    """Built by `component.create_tail_replay_cache` with the process's runtime."""

    def __init__(self, params, runtime):
        self.runtime = runtime  # before SGLang's init, which calls init_hicache
        super().__init__(params)

    def init_hicache(self, server_args, params) -> None:
        super().init_hicache(server_args, params)
        if self.cache_controller is None or self.runtime.store is None:
            return
        kv_host = self.host_pool_group.anchor_entry.host_pool
        store = self.runtime.store
        host_pool = HiddenHostPool(store, kv_host.size + kv_host.page_size, kv_host.page_size,
                                   pin_memory=store.hiddens.is_cuda)
        self.register_sidecar_pool(SidecarPoolSpec(HIDDEN_POOL, PoolName.KV),
                                   PoolEntry(name=HIDDEN_POOL, host_pool=host_pool, device_pool=store,
                                             layer_mapper=None))
        logger.info("Tail-Replay: hidden store's host twin for HiCache, %d host slots, %.1f MiB", host_pool.size,
                    host_pool.nbytes / 2**20)

    def init_load_back(self, params):
        loaded = super().init_load_back(params)
        req = params.req
        state = peek(req)
        if loaded is None or state is None or state.match is None:
            return loaded
        loaded_len, node_id = loaded
        self.components[ComponentType.MAMBA].replan_after_load(req, node_id, req.prefix_len + loaded_len)
        return loaded

    def write_backup_storage(self, node_id) -> None:
        if is_tainted(self.tree_core.node_by_id(node_id)):
            return
        super().write_backup_storage(node_id)

