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
its anchor from there (`anchor_copy.restore_from_hicache`); from the host pool they go to storage with their nodes'
pages, and a storage hit past the exact budget reads the deepest one within the budget of its end
(`storage_anchors.py`).
"""

import json
import logging

from sglang.srt.mem_cache.hicache_storage import PoolName, SidecarPoolSpec
from sglang.srt.mem_cache.pool_host.group import PoolEntry
from sglang.srt.mem_cache.unified_cache.cache_action import BackupKV
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from tailreplay_sglang.cache.request import is_tainted, peek
from tailreplay_sglang.cache.storage_key import claim_file_folder, file_folder, state_tag, with_storage_tag
from tailreplay_sglang.store.hicache_pool import HiddenHostPool

logger = logging.getLogger(__name__)

# SGLang's pool names are a closed enum. INDEXER is the KV-derived sidecar slot only sparse-attention models fill
# (their indexer keys); no hybrid model Tail-Replay supports has one, so the hidden store takes it.
HIDDEN_POOL = PoolName.INDEXER


def keep_folded_match(original, scheduler, req) -> bool:
    """Around `Scheduler._prefetch_after_device_hit_loss`: SGLang re-queries storage when a request's match at
    admission is shorter than the one its storage lookup saw (device KV evicted while it queued). A hit that folds
    to its anchor (`component.plan_hit`) is shorter by design, and the lookup (`_prefetch_kvcache`, which matches
    without planning a hit) never sees the fold: every such request was re-queried up to SGLang's cap (8 storage
    lookups each, measured in bench/router.py's log). The folded match counts as the one the lookup saw."""
    state = peek(req)
    seen = req.storage_prefetch_last_match_len
    if state is not None and state.folded_from is not None and seen and state.folded_from >= seen:
        req.storage_prefetch_last_match_len = req.prefix_len + req.host_hit_length
        return False
    return original(scheduler, req)


class TailReplayRadixCache(UnifiedRadixCache):
    """Built by `component.create_tail_replay_cache` with the process's runtime."""

    def __init__(self, params, runtime):
        self.runtime = runtime  # before SGLang's init, which calls init_hicache
        self._state_backups: list = []  # anchors to back up to the host (then storage) at a later step
        self._state_writes: list = []  # (node, CUDA event or None): states to write to storage at the next step
        super().__init__(params)

    def init_hicache(self, server_args, params) -> None:
        self._tag_state_layout(params)
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

    def _tag_state_layout(self, params) -> None:
        """The launcher's page tag (`storage_key.storage_tag`) extended by the layout of this server's states
        (`storage_key.state_tag`), known only here: Mooncake's before HiCache reads the extra config; a `file`
        folder claimed for it (`storage_key.claim_file_folder`), the start-up refused where another tag holds it."""
        from sglang.srt.runtime_context import get_memory

        memory = get_memory()
        if memory.hicache_storage_backend not in ("mooncake", "file") or self.runtime.store is None:
            return
        tag = state_tag(params.req_to_token_pool.mamba_pool.mamba_cache)
        if memory.hicache_storage_backend == "file":
            extra = memory.hicache_storage_backend_extra_config
            claim_file_folder(file_folder(extra), json.loads(with_storage_tag(extra, tag))["extra_backend_tag"])
            return
        # the scheduler's own copy of the flags, read-only to SGLang's code: this is the one write before any read
        memory._set("hicache_storage_backend_extra_config",
                    with_storage_tag(memory.hicache_storage_backend_extra_config, tag))
        logger.info("Tail-Replay: storage tag %s", json.loads(memory.hicache_storage_backend_extra_config)[
            "extra_backend_tag"])

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

    def back_up_state(self, node_id) -> None:
        """An anchor inserted at a node whose KV is already backed up (its request's write-through was issued
        before the anchor's insert split the node there) gets no host copy from SGLang, so no place in storage
        either: its backup is issued at a scheduler step where the node has no write-through pending, the state
        alone (SGLang's backup spec leaves out KV on the host), and that backup's ack writes it to storage with the
        node's pages. Only with storage: a host hit copies an anchor the device pool evicts itself
        (`_backup_state_to_hicache`)."""
        if self.cache_controller is not None and self.enable_storage:
            self._state_backups.append(self.tree_core.node_by_id(node_id))

    def write_state_to_storage(self, node, copied=None) -> None:
        """A state that got its host copy after its node's pages were written (an evicted interval anchor) goes to
        storage at the next scheduler step, once the copy (`copied`, a CUDA event on the forwards' stream) is done:
        not from inside the eviction that made the copy, whose walk the storage write's host lock would change."""
        if self.enable_storage:
            self._state_writes.append((node, copied))

    def check_hicache_events(self) -> None:
        super().check_hicache_events()  # write-through acks first: they clear the nodes' pending backups
        backups, self._state_backups = self._state_backups, []
        for node in backups:
            state = node.component_data[ComponentType.MAMBA]
            if not self._in_tree(node) or state.value is None or state.host_value is not None or not node.backuped:
                continue  # evicted (`_backup_state_to_hicache` took over), deleted, or backed up since
            if node.write_through_pending_id is not None:
                self._state_backups.append(node)  # its KV's own write-through: after its ack
            else:
                self._execute_and_commit_kv_backup(BackupKV(node_ids=[node.id]))
        writes, self._state_writes = self._state_writes, []
        for node, copied in writes:
            if copied is not None and not copied.query():  # behind a forward still running: at a later step
                self._state_writes.append((node, copied))  # (a wait here would stall scheduling; review D)
                continue
            state = node.component_data[ComponentType.MAMBA]
            if self._in_tree(node) and node.backuped and state.host_value is not None:
                self.write_backup_storage(node.id)  # its KV and hidden pages again, which the backends skip

    def _in_tree(self, node) -> bool:
        try:
            return self.tree_core.node_by_id(node.id) is node
        except KeyError:  # deleted since
            return False

