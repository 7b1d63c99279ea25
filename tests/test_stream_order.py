"""The GPU path's stream order, checked on the CPU route (`../shared/notes/gpu-path-review-2026-12-04.md`): every
copy that feeds a kernel on the forwards' stream is queued on that stream. On a CPU streams do not exist, so these
tests replace `on_forward_stream` with one that records which calls ran inside it."""

import contextlib
from types import SimpleNamespace

import torch

from tailreplay_sglang.cache import component
from tailreplay_sglang.cache.component import TailReplayMambaComponent


class _Recorder:
    """Which calls happened, and whether the forwards' stream was current for each."""

    def __init__(self):
        self.on_forward, self.calls = False, []

    @contextlib.contextmanager
    def stream(self, stream):
        assert stream == "forward-stream"
        self.on_forward = True
        try:
            yield
        finally:
            self.on_forward = False

    def record(self, name, result=None):
        def call(*args, **kwargs):
            self.calls.append((name, self.on_forward))
            return result
        return call


def test_an_anchor_backed_up_to_hicache_has_its_index_copied_on_the_forward_stream(monkeypatch):
    """N1: `_backup_state_to_hicache` copies the host index to the device (`move_indices`) for the backup kernel,
    which runs on the forwards' stream; from the scheduler's stream the copy raced the kernel and its block could
    be reused before the kernel read it (an anchor in another node's host slot, restored later as exact). Both the
    index copy and the kernel are queued with the forwards' stream current."""
    rec = _Recorder()
    monkeypatch.setattr(component, "on_forward_stream", rec.stream)
    host_value, device = torch.tensor([3]), torch.tensor([5])
    entry = SimpleNamespace(device_pool="mamba-pool", host_pool=SimpleNamespace(
        backup_from_device_all_layer=rec.record("backup kernel")))
    controller = SimpleNamespace(io_backend="kernel", move_indices=rec.record("move_indices", (host_value, device)))
    group = SimpleNamespace(alloc=lambda n, pool: host_value, get_entry=lambda pool: entry)
    written = []  # the state's storage write, queued for a later step with the copy's event (none on a CPU)
    self = SimpleNamespace(component_type="mamba", cache=SimpleNamespace(
                               host_pool_group=group, cache_controller=controller,
                               write_state_to_storage=lambda node, copied: written.append(copied)),
                           runtime=SimpleNamespace(forward_stream="forward-stream",
                                                   count_hicache_anchor_backup=lambda: None))
    data = SimpleNamespace(value=device, host_value=None)
    TailReplayMambaComponent._backup_state_to_hicache(self, SimpleNamespace(component_data={"mamba": data}))
    assert rec.calls == [("move_indices", True), ("backup kernel", True)]
    assert data.host_value.tolist() == [3] and written == [None]


def test_the_anchor_copy_on_write_does_not_wait_for_the_batchs_load_back():
    """N5: stock's copy-on-write waits for the last mamba layer of the batch's HiCache load-back (a stock source can
    be a state loading back), which held an anchored hit's replay until nearly all its KV had paged back. Our
    sources are device anchors that no load-back writes, so the copy runs at once; with no load-back in flight it is
    stock's. Stock's own function, on the same pool, waits: the test tells the two apart."""
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    from tailreplay_sglang.cache.anchor_copy import copy_without_load_wait

    copied, waits = [], []
    counter = SimpleNamespace(consumer_index=0, wait_until=waits.append)
    pool = SimpleNamespace(layer_transfer_counter=counter, mamba_map={0: 0, 3: 1}, start_layer=0,
                           mamba_pool=SimpleNamespace(copy_from=lambda src, dst: copied.append((src, dst))))
    src, dst = torch.tensor([4]), torch.tensor([9])
    HybridReqToTokenPool.copy_mamba_state(pool, src, dst)
    assert waits == [3] and len(copied) == 1  # stock: the last mamba layer's load first
    copy_without_load_wait(HybridReqToTokenPool.copy_mamba_state, pool, src, dst)
    assert waits == [3] and copied[-1] == (src, dst)
    pool.layer_transfer_counter = None  # no HiCache
    copy_without_load_wait(HybridReqToTokenPool.copy_mamba_state, pool, src, dst)
    assert len(copied) == 3


def test_no_load_back_writes_a_mamba_state():
    """What N5's skipped wait rests on: the MAMBA component builds no load-back transfer, so HiCache's H2D stream
    never writes a mamba slot (a hit restores its host anchor itself, in the forward: `anchor_copy.restore_host`)."""
    from sglang.srt.mem_cache.unified_cache.components import CacheTransferPhase

    self = SimpleNamespace(component_type="mamba")
    assert TailReplayMambaComponent.build_hicache_transfers(self, None, CacheTransferPhase.LOAD_BACK) is None
