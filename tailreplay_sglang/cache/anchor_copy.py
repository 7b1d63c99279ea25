"""An anchor's state into a hit's slot, copied where SGLang runs its own copy-on-write: inside the forward.

A hit that starts from an anchor gets its own mamba slot at the match, as a stock hit does, and the state is copied
into it by the forward that reads it:
- a device anchor through SGLang's deferred copy-on-write: the match sets `req.kv.mamba_cow_src_index`,
  `ScheduleBatch.prepare_for_extend` gathers the batch's sources into one index tensor and
  `ModelRunner._maybe_execute_deferred_mamba_cow_and_clear` copies them on the stream the forward runs on, after its
  waits;
- a host anchor by `restore_host`, from the hook that runs right after that copy (`lifecycle.replay_after_clear`).
Copying at the match instead would race the forward on a GPU (`../shared/notes/gpu-path-review.md`, F1).

A stock hit's source is its own match end, which the request's tree lock keeps. Ours is an anchor above it, so it is
held from the match until its copy no longer needs it:
- a device anchor by a tree lock until the scheduler has formed the batch. Its slot id is then in the batch's own
  index tensor, and any later write to that slot comes from a later forward, ordered after this copy;
- a host anchor by a pin in the host pool until the forward's restore has run.
`release` runs when `Scheduler.get_new_batch_prefill` returns, for the requests of the new batch and for those the
scheduler matched but did not admit (SGLang frees their slot and clears their copy source itself). So no hold
outlives the scheduling step that took it, whatever happens to the request later (abort, retraction, flush).
"""

from dataclasses import dataclass


@dataclass
class _Held:
    req: object
    node: object  # the anchor's tree node
    lock: object | None  # the tree lock on a device anchor; None for a host anchor (pinned in the host pool)


class StagedAnchors:
    """The anchors hits were matched to in the current scheduling step, and the host restores of its batch."""

    def __init__(self):
        self._held: list[_Held] = []  # from the match until the batch is formed
        self._restores: list[_Held] = []  # host anchors of the formed batch, until its forward

    def hold_device(self, cache, req, anchor) -> None:
        """Lock the anchor (before the hit's slot is allocated: the allocation may evict) and take its state as the
        request's copy-on-write source."""
        self._held.append(_Held(req, anchor, cache.inc_lock_ref(anchor.id)))

    def hold_host(self, host_anchors, req, anchor) -> None:
        host_anchors.pin(anchor)
        self._held.append(_Held(req, anchor, None))

    def release(self, cache, host_anchors, admitted) -> None:
        """The scheduler formed its batch (`admitted`: its requests; empty when none was formed)."""
        for held in self._held:
            if held.lock is not None:
                cache.dec_lock_ref(held.node.id, held.lock.to_dec_params())
            elif any(req is held.req for req in admitted):
                self._restores.append(held)
            else:  # not admitted: SGLang freed its slot, nothing is restored
                host_anchors.unpin(held.node)
        self._held.clear()

    def restore_host(self, host_anchors, req_to_token_pool) -> None:
        """In the forward of the batch they were admitted to: each host anchor into its request's slot."""
        for held in self._restores:
            slot = int(req_to_token_pool.translate_mamba_indices(held.req.kv.mamba_pool_idx.view(1))[0])
            host_anchors.restore(held.node, req_to_token_pool.mamba_pool, slot)
            host_anchors.unpin(held.node)
        self._restores.clear()

    def __len__(self) -> int:
        return len(self._held) + len(self._restores)
