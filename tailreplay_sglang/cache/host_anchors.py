"""Host-memory anchors (`--tail-replay-host-anchors N`): recurrent states the device mamba pool evicts, kept in host
memory for hits that would otherwise have no anchor within the exact budget.

A device mamba slot is scarce: one Qwen3.5-4B state is about 48 MiB, so a GPU's mamba pool holds far fewer anchors
than its KV pool holds tokens, and under load the tree's KV outlives its anchors and hits turn approximate. When the
mamba LRU tombstones an anchor (`TailReplayMambaComponent._evict_device_next_node`), its state is copied here first
and the node keeps its KV; a hit whose deepest anchor is on the host gets a fresh device slot, the state is copied
back into it and the replay runs from it, exactly. The host pool has its own LRU: dropping a host state drops only
that state (the node's KV still hits, through a shallower anchor or the zero-init tail). A node the tree deletes
(its KV evicted) or a flushed tree takes its host state with it.

States are keyed by tree node: SGLang keeps a node's mamba state on the child when it splits a node
(`MambaComponent.redistribute_on_node_split`), so the node keeps its depth's state, and the tree reports every
deleted node to its components (`discard_deleted_session_leaf`). SGLang's own host mamba pool (`MambaPoolHost`) is
HiCache's: it comes with the hierarchical cache's controller, page layouts and transfer kernels built from CUDA
source, and moves every node's state, not the ones the device pool lets go. This pool is a plain pair of tensors
shaped like the device pool's, pinned on CUDA.

A device-to-host save runs on the stream the forwards run on (`component.on_forward_stream`), ordered after the
forward that wrote the state and before any later forward that reuses the freed device slot; a host-to-device
restore runs inside the forward of the hit's batch, on the same stream (`anchor_copy`), before the replay that reads
it. Both go through this pool's own pinned slots, which only later copies on that stream overwrite.
`copy_seconds` is the host's wall time for the copies: on CUDA that is the time to enqueue them.
"""

import time
from collections import OrderedDict

import torch


class HostAnchors:
    def __init__(self, mamba_pool, capacity: int):
        cache = mamba_pool.mamba_cache
        pin = cache.temporal.is_cuda  # pinned memory exists only next to an accelerator

        def host_like(t: torch.Tensor) -> torch.Tensor:
            # [capacity, layers, ...]: slot-major, so that one state is contiguous in pinned memory and its copies
            # are single asynchronous transfers (a strided pinned view would go through a pageable temporary)
            return torch.zeros((capacity, t.shape[0], *t.shape[2:]), dtype=t.dtype, pin_memory=pin)

        self.capacity = capacity
        self.conv = [host_like(c) for c in cache.conv]
        self.temporal = host_like(cache.temporal)
        self._free = list(range(capacity - 1, -1, -1))
        self._slots: OrderedDict = OrderedDict()  # tree node -> host slot, least recently used first
        self._pinned: dict = {}  # node -> hits whose restore is staged (`anchor_copy`): its state is not dropped
        self._root: object = None  # the tree these nodes belong to (a flush builds a new root)
        self.saved = self.restored = self.dropped = 0
        self.copy_seconds = 0.0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, self.temporal))

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, node) -> bool:
        return node in self._slots

    def follow_tree(self, root) -> None:
        """Forget every state of an earlier tree: after a flush SGLang's tree has a new root and none of its nodes."""
        if root is not self._root:
            self._root = root
            self._free.extend(self._slots.values())
            self._slots.clear()

    def save(self, node, mamba_pool, device_slot: torch.Tensor) -> bool:
        """Copy the state in physical device slot `device_slot` (a one-element index tensor on the device: the slot
        is never read on the host, which would wait for the forwards queued before it) to the host as `node`'s,
        dropping the least recently used host state if the pool is full. False if every host state is kept."""
        if node in self._slots:  # the same path's state, saved before: still exact
            self._slots.move_to_end(node)
            return True
        if not self._free and not self._drop_lru():
            return False
        slot = self._free.pop()
        self._copy(mamba_pool, device_slot, slot, to_host=True)
        self._slots[node] = slot
        self.saved += 1
        return True

    def restore(self, node, mamba_pool, device_slot: torch.Tensor) -> None:
        """Copy `node`'s host state into physical device slot `device_slot` (as in `save`). The host copy stays, as
        the anchor."""
        slot = self._slots[node]
        self._slots.move_to_end(node)
        self._copy(mamba_pool, device_slot, slot, to_host=False)
        self.restored += 1

    def pin(self, node) -> None:
        """`node`'s state is not dropped until as many `unpin`s: from a hit's match, whose slot allocation may evict
        device anchors into this pool, until its restore ran in the forward."""
        self._pinned[node] = self._pinned.get(node, 0) + 1

    def unpin(self, node) -> None:
        left = self._pinned.pop(node) - 1
        if left:
            self._pinned[node] = left

    @property
    def pins(self) -> int:
        """Pins not yet dropped: none once no scheduling step is under way (each hit unpins in its forward)."""
        return sum(self._pinned.values())

    def discard(self, node) -> None:
        slot = self._slots.pop(node, None)
        if slot is not None:
            self._free.append(slot)

    def _drop_lru(self) -> bool:
        victim = next((node for node in self._slots if node not in self._pinned), None)
        if victim is None:
            return False
        self.discard(victim)
        self.dropped += 1
        return True

    def _copy(self, mamba_pool, device_slot: torch.Tensor, host_slot: int, to_host: bool) -> None:
        start = time.perf_counter()
        cache, index = mamba_pool.mamba_cache, device_slot.long().view(1)
        for device, host in zip((*cache.conv, cache.temporal), (*self.conv, self.temporal)):
            # a gather and a scatter on the device by index, each beside one asynchronous copy of pinned memory
            if to_host:
                host[host_slot].copy_(device.index_select(1, index).squeeze(1), non_blocking=True)
            else:
                device.index_copy_(1, index, host[host_slot].unsqueeze(1).to(device.device, non_blocking=True))
        self.copy_seconds += time.perf_counter() - start
