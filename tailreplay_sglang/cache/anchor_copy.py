"""An anchor's state into a hit's slot, copied where SGLang runs its own copy-on-write: inside the forward.

A hit that starts from an anchor gets its own mamba slot at the match, as a stock hit does, and the state is copied
into it by the forward that reads it:
- a device anchor through SGLang's deferred copy-on-write: the match sets `req.kv.mamba_cow_src_index`,
  `ScheduleBatch.prepare_for_extend` gathers the batch's sources into one index tensor and
  `ModelRunner._maybe_execute_deferred_mamba_cow_and_clear` copies them on the stream the forward runs on, after its
  waits;
- a host anchor (the plugin's host anchors, or HiCache's host mamba pool, where an anchor goes with its node's KV)
  by `restore_host`, from the hook that runs right after that copy (`lifecycle.replay_after_clear`).
Copying at the match instead would race the forward on a GPU (`../shared/notes/gpu-path-review.md`, F1).

A stock hit's source is its own match end, which the request's tree lock keeps. Ours is an anchor above it, so it is
held from the match until its copy no longer needs it:
- a device anchor by a tree lock until the scheduler has formed the batch. Its slot id is then in the batch's own
  index tensor, and any later write to that slot comes from a later forward, ordered after this copy;
- a host anchor by a pin in the host pool until the forward's restore has been queued (later writes to that host
  slot are saves, queued on the same stream); HiCache's by a host lock on its node until an event recorded after
  the restore has completed, since HiCache's storage prefetch can evict and rewrite that host slot from its IO
  thread, outside any stream order (GPU path review B; `StagedAnchors.unlock_restored`).
`release` runs when `Scheduler.get_new_batch_prefill` returns, for the requests of the new batch and for those the
scheduler matched but did not admit, whose slot it frees (`unstage`) if SGLang has not. So no hold outlives the
scheduling step that took it, whatever happens to the request later (abort, retraction, flush).
"""

from dataclasses import dataclass

import torch


@dataclass
class _Held:
    req: object
    node: object  # the anchor's tree node
    lock: object | None  # the tree lock on a device anchor; None for a host anchor (pinned in the host pool)
    hicache: object | None = None  # the cache whose host lock holds an anchor in HiCache's host mamba pool

    def unhold_host(self, host_anchors) -> None:
        if self.hicache is not None:
            self.hicache.dec_host_lock_ref(self.node.id, self.lock.to_dec_params())
        else:
            host_anchors.unpin(self.node)


class StagedAnchors:
    """The anchors hits were matched to in the current scheduling step, and the host restores of its batch."""

    def __init__(self):
        self._held: list[_Held] = []  # from the match until the batch is formed
        self._restores: list[_Held] = []  # host anchors of the formed batch, until its forward
        # HiCache anchors restored by a forward, with the event after their copy: host-locked until it completes
        self._restoring: list[tuple[_Held, object]] = []

    def hold_device(self, cache, req, anchor) -> None:
        """Lock the anchor (before the hit's slot is allocated: the allocation may evict) and take its state as the
        request's copy-on-write source."""
        self._held.append(_Held(req, anchor, cache.inc_lock_ref(anchor.id)))

    def hold_host(self, host_anchors, req, anchor) -> None:
        host_anchors.pin(anchor)
        self._held.append(_Held(req, anchor, None))

    def hold_hicache(self, cache, req, anchor) -> None:
        self._held.append(_Held(req, anchor, cache.inc_host_lock_ref(anchor.id), hicache=cache))

    def release(self, cache, host_anchors, admitted) -> None:
        """The scheduler formed its batch (`admitted`: its requests; empty when none was formed)."""
        self.unlock_restored(host_anchors)
        for held in self._held:
            is_admitted = any(req is held.req for req in admitted)
            if held.lock is not None and held.hicache is None:
                cache.dec_lock_ref(held.node.id, held.lock.to_dec_params())
            elif is_admitted:
                self._restores.append(held)
            else:
                held.unhold_host(host_anchors)
            if not is_admitted:
                unstage(cache, held.req)
        self._held.clear()

    def drop(self, cache, host_anchors, req) -> None:
        """Let go of what `req` holds: its plan changed before the batch was formed (`replan_after_load`)."""
        keep = []
        for held in self._held:
            if held.req is not req:
                keep.append(held)
            elif held.lock is not None and held.hicache is None:
                cache.dec_lock_ref(held.node.id, held.lock.to_dec_params())
            else:
                held.unhold_host(host_anchors)
        self._held = keep

    def restore_host(self, host_anchors, req_to_token_pool) -> None:
        """In the forward of the batch they were admitted to: each host anchor into its request's slot."""
        for held in self._restores:
            slot = req_to_token_pool.translate_mamba_indices(held.req.kv.mamba_pool_idx.view(1))  # on the device
            if held.hicache is not None:  # both copies take the slot as a device index: nothing read on the host
                restore_from_hicache(held.hicache, held.node, slot)
                self._restoring.append((held, copy_done_event()))
            else:
                host_anchors.restore(held.node, req_to_token_pool.mamba_pool, slot)
                held.unhold_host(host_anchors)
        self._restores.clear()
        self.unlock_restored(host_anchors)

    def unlock_restored(self, host_anchors) -> None:
        """Give back the host locks of HiCache anchors whose restore has run on the device (at once on a CPU, where
        the copy ran when it was called). Called after each restore and at every scheduling step."""
        pending = []
        for held, done in self._restoring:
            if done is None or done.query():
                held.unhold_host(host_anchors)
            else:
                pending.append((held, done))
        self._restoring = pending

    def __len__(self) -> int:
        return len(self._held) + len(self._restores) + len(self._restoring)


def copy_done_event():
    """An event recorded on the current (the forward's) stream after the copies just queued; None off CUDA."""
    if not torch.cuda.is_available():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def copy_without_load_wait(original, pool, src_index, dst_index) -> None:
    """Around `HybridReqToTokenPool.copy_mamba_state`, the batch's deferred copy-on-write (run before the replay, on
    the forward's stream). Under HiCache stock first waits for the last mamba layer of the batch's load-back: a stock
    hit's source can be a state loading back in this batch. Ours are device anchors, which no load-back writes (the
    MAMBA component builds no LOAD_BACK transfer: a host anchor is restored by `restore_host`, in the forward), so the
    wait only held an anchored hit's replay until nearly all its KV had paged back (GPU path review N5); without it
    the replay starts after the first layer's load (`replay.wait_for_loaded_rows`), each layer's after its own, and
    overlaps the later layers' loads."""
    if src_index.numel() == 0 or pool.layer_transfer_counter is None:
        return original(pool, src_index, dst_index)
    pool.mamba_pool.copy_from(src_index, dst_index)


def unstage(cache, req) -> None:
    """A request matched but not admitted gives back the slot its match took, as SGLang does for the request its
    adder stopped at: SGLang keeps it for one it skipped after the match (a HiCache prefetch retried after its device
    hit was lost), and that request's next match, seeing a slot, would keep a plan whose anchor is released here."""
    if not req.kv.holds_mamba:
        return
    cache.req_to_token_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
    req.kv.mamba_pool_idx = None
    req.kv.mamba_cow_src_index = None
    req.kv.mamba_needs_clear = False


def restore_from_hicache(cache, node, device_slot: torch.Tensor) -> None:
    """Copy `node`'s state from HiCache's host mamba pool into physical device slot `device_slot` (a one-element
    index tensor), every layer, with the pool's own per-layer copies and SGLang's io backend
    (`--hicache-io-backend`)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    entry = cache.host_pool_group.get_entry(PoolName.MAMBA)
    controller = cache.cache_controller
    host_value = node.component_data[ComponentType.MAMBA].host_value.long().view(-1)
    # the devices the controller's own transfers put these indices on, for its io backend
    host_indices, device_indices = controller.move_indices(
        host_value, device_slot.to(controller.device, torch.int64).view(-1))
    for layer_id in range(entry.host_pool.num_mamba_layers):
        entry.host_pool.load_to_device_per_layer(entry.device_pool, host_indices, device_indices, layer_id,
                                                 controller.io_backend)
