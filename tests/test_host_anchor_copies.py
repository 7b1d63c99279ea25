"""The host anchors' copies (`cache/host_anchors.py`) on the device the tests run on, no SGLang needed: on CUDA
(scripts/gpu_check.sh runs this file natively) a save is a gather by device index and an asynchronous copy into
pinned memory, a restore an asynchronous copy out of it and a scatter by index, all on one stream; on a CPU the same
code runs synchronously. Every state must come back whole, although the device slot it was saved from is
overwritten right after its save and host slots are reused."""

from types import SimpleNamespace

import torch

from tailreplay_sglang.cache.host_anchors import HostAnchors

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pool(layers: int = 4, slots: int = 10):
    g = torch.Generator().manual_seed(0)
    conv = [torch.randn(layers, slots, 8, 3, generator=g).to(DEVICE), torch.randn(layers, slots, 5, generator=g)
            .to(DEVICE, torch.bfloat16)]
    return SimpleNamespace(mamba_cache=SimpleNamespace(conv=conv, temporal=torch.randn(
        layers, slots, 2, 4, 4, generator=g).to(DEVICE)))


def _states(pool, slot: int) -> list[torch.Tensor]:
    cache = pool.mamba_cache
    return [t[:, slot].clone() for t in (*cache.conv, cache.temporal)]


def test_saved_states_come_back_whole_through_reused_host_slots():
    pool = _pool()
    host = HostAnchors(pool, capacity=2)
    assert host.temporal.is_pinned() == (DEVICE == "cuda")
    nodes, saved = [object() for _ in range(5)], {}
    for i, node in enumerate(nodes):
        assert host.save(node, pool, torch.tensor([i], device=DEVICE, dtype=torch.int32))  # SGLang's slot ids
        saved[node] = _states(pool, i)
        for t in (*pool.mamba_cache.conv, pool.mamba_cache.temporal):
            t[:, i] = 0  # the device slot is reused right after its save
    kept = nodes[-2:]  # the pool's LRU dropped the first three, their host slots reused
    assert [node in host for node in nodes] == [False, False, False, True, True] and host.dropped == 3
    for j, node in enumerate(kept):
        host.restore(node, pool, torch.tensor([7 + j], device=DEVICE))
    for j, node in enumerate(kept):
        for got, want in zip(_states(pool, 7 + j), saved[node]):
            assert torch.equal(got, want)
    assert _states(pool, 9)[0].ne(0).any()  # a slot no restore names is left alone


def test_a_saved_index_freed_on_the_scheduler_stream_is_not_reused_before_the_forwards_save_reads_it():
    """GPU path review A, natively on CUDA (scripts/gpu_check.sh): the save is queued on the forwards' stream behind
    a long kernel, the node's index tensor is freed on the scheduler's stream and a new tensor allocated there. With
    `keep_for_forward_stream` the allocator does not hand the index's block out before the save read it, so the host
    anchor holds slot 3's state, not that of the slot the new tensor's value names."""
    import pytest

    from tailreplay_sglang.cache.component import keep_for_forward_stream, on_forward_stream

    if DEVICE != "cuda":
        pytest.skip("the caching allocator's cross-stream reuse exists on CUDA only")
    pool, node = _pool(), object()
    host = HostAnchors(pool, capacity=1)
    scheduler, forward = torch.cuda.Stream(), torch.cuda.Stream()
    want = _states(pool, 3)
    with torch.cuda.stream(scheduler):
        index = torch.tensor([[3]], device=DEVICE).clone()
        with on_forward_stream(forward):
            torch.cuda._sleep(200_000_000)  # the in-flight forward
            keep_for_forward_stream(index, forward)
            host.save(node, pool, index.view(-1)[:1])
        del index  # the eviction's free, on the scheduler's stream
        reused = torch.full((1, 1), 8, device=DEVICE)  # the next small allocation there
    torch.cuda.synchronize()
    del reused
    host.restore(node, pool, torch.tensor([9], device=DEVICE))
    torch.cuda.synchronize()
    for got, expected in zip(_states(pool, 9), want):
        assert torch.equal(got, expected)


def test_a_pinned_host_anchor_is_never_the_one_dropped():
    """Issue 65 class 5: a hit's host anchor is pinned from its match until its restore ran; a save that needs room
    meanwhile drops the least recently used unpinned state, or none (the save is refused) when all are pinned. Pins
    count: two hits on one anchor keep it until both unpin."""
    pool = _pool()
    host = HostAnchors(pool, capacity=2)
    a, b, c, d = (object() for _ in range(4))
    for i, node in enumerate((a, b)):
        assert host.save(node, pool, torch.tensor([i], device=DEVICE))
    host.pin(a)  # a is the least recently used, but a hit holds it
    assert host.save(c, pool, torch.tensor([2], device=DEVICE))
    assert a in host and b not in host and c in host and host.dropped == 1
    host.pin(c)
    host.pin(c)
    assert not host.save(d, pool, torch.tensor([3], device=DEVICE)) and d not in host  # every state is pinned
    host.unpin(c)
    assert not host.save(d, pool, torch.tensor([3], device=DEVICE))  # c still has one pin
    host.unpin(c)
    assert host.save(d, pool, torch.tensor([3], device=DEVICE)) and a in host and c not in host
    host.unpin(a)
    assert host.pins == 0


def test_a_hicache_anchors_host_lock_outlives_its_restore_on_cuda(monkeypatch):
    """GPU path review B, natively on CUDA (scripts/gpu_check.sh): a HiCache anchor's restore is queued on the
    forwards' stream behind a long kernel. Its host lock stays held at every scheduling step until the event recorded
    after the copy (`copy_done_event`, real here) has completed; then it is given back, and a storage prefetch that
    rewrites the host slot at once (as from HiCache's IO thread) no longer reaches the restored state."""
    import pytest

    from tailreplay_sglang.cache import anchor_copy

    if DEVICE != "cuda":
        pytest.skip("a restore queued behind a running kernel exists on CUDA only")
    host_slot = torch.randn(4, 64).pin_memory()
    want = host_slot.clone()
    device_slot = torch.zeros(4, 64, device=DEVICE)
    forward = torch.cuda.Stream()
    monkeypatch.setattr(anchor_copy, "restore_from_hicache",
                        lambda cache, node, slot: device_slot.copy_(host_slot, non_blocking=True))
    unlocked = []
    lock = SimpleNamespace(to_dec_params=lambda: None)
    cache = SimpleNamespace(inc_host_lock_ref=lambda node_id: lock,
                            dec_host_lock_ref=lambda node_id, params: unlocked.append(node_id))
    host_anchors = SimpleNamespace(pin=lambda node: None, unpin=lambda node: None)
    pool = SimpleNamespace(translate_mamba_indices=lambda index: index, mamba_pool=None)
    req = SimpleNamespace(kv=SimpleNamespace(mamba_pool_idx=torch.tensor(0)))
    staged = anchor_copy.StagedAnchors()
    staged.hold_hicache(cache, req, SimpleNamespace(id=10))
    staged.release(cache, host_anchors, admitted=[req])
    with torch.cuda.stream(forward):
        torch.cuda._sleep(200_000_000)  # the forward before the restore, still running
        staged.restore_host(host_anchors, pool)
    staged.release(cache, host_anchors, admitted=())  # the next scheduling step: the copy is still queued
    assert unlocked == [] and len(staged) == 1
    forward.synchronize()
    staged.release(cache, host_anchors, admitted=())
    assert unlocked == [10] and len(staged) == 0
    host_slot.fill_(-1.0)  # the prefetch's rewrite, once the lock is given back
    torch.cuda.synchronize()
    assert torch.equal(device_slot.cpu(), want)
