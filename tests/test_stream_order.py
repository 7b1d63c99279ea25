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


def _keep_alive_recorder(monkeypatch, rec) -> list:
    """`record_stream` calls as (tensor, stream, forwards' stream current), with "forward-stream" taken for CUDA's."""
    kept = []
    monkeypatch.setattr(component, "is_cuda_stream", lambda stream: stream == "forward-stream")
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: kept.append((self, stream, rec.on_forward)))
    return kept


def test_an_anchor_backed_up_to_hicache_keeps_its_index_alive_for_the_forward_stream(monkeypatch):
    """A: the backup kernel queued on the forwards' stream reads the node's device index, which the eviction frees
    on the scheduler's stream right after; without `record_stream` the block can be reused and overwritten first
    (after a decode-graph step the scheduler's stream waits only for a marker near the graph's start)."""
    rec = _Recorder()
    monkeypatch.setattr(component, "on_forward_stream", rec.stream)
    kept = _keep_alive_recorder(monkeypatch, rec)
    host_value, device = torch.tensor([3]), torch.tensor([5])
    entry = SimpleNamespace(device_pool="mamba-pool", host_pool=SimpleNamespace(
        backup_from_device_all_layer=rec.record("backup kernel")))
    controller = SimpleNamespace(io_backend="kernel", move_indices=rec.record("move_indices", (host_value, device)))
    group = SimpleNamespace(alloc=lambda n, pool: host_value, get_entry=lambda pool: entry)
    monkeypatch.setattr(torch.cuda, "Event", lambda: SimpleNamespace(record=lambda: None))
    self = SimpleNamespace(component_type="mamba", cache=SimpleNamespace(
                               host_pool_group=group, cache_controller=controller,
                               write_state_to_storage=lambda node, copied: None),
                           runtime=SimpleNamespace(forward_stream="forward-stream",
                                                   count_hicache_anchor_backup=lambda: None))
    data = SimpleNamespace(value=device, host_value=None)
    TailReplayMambaComponent._backup_state_to_hicache(self, SimpleNamespace(component_data={"mamba": data}))
    assert [(t is device, stream, on_forward) for t, stream, on_forward in kept] == [(True, "forward-stream", True)]


def test_an_anchor_saved_to_host_keeps_its_index_alive_for_the_forward_stream(monkeypatch):
    """A, for host anchors: `_save_to_host` gathers the state by the node's device index on the forwards' stream
    (N7 removed the `int()` that read it first), and the eviction then frees that index."""
    rec = _Recorder()
    monkeypatch.setattr(component, "on_forward_stream", rec.stream)
    kept = _keep_alive_recorder(monkeypatch, rec)
    value, saved = torch.tensor([[7]]), []
    host = SimpleNamespace(follow_tree=lambda root: None,
                           save=lambda node, pool, slot: saved.append((slot.tolist(), rec.on_forward)))
    pool = SimpleNamespace(translate_mamba_indices=lambda index: index, mamba_pool="mamba-pool")
    self = SimpleNamespace(component_type="mamba", tree_core=SimpleNamespace(root_node=None),
                           cache=SimpleNamespace(req_to_token_pool=pool),
                           runtime=SimpleNamespace(host_anchors=host, forward_stream="forward-stream"))
    node = SimpleNamespace(component_data={"mamba": SimpleNamespace(value=value)})
    TailReplayMambaComponent._save_to_host(self, node)
    assert saved == [([7], True)]
    assert [(t is value, stream, on_forward) for t, stream, on_forward in kept] == [(True, "forward-stream", True)]


def test_a_hicache_anchor_keeps_its_host_lock_until_its_restore_has_run(monkeypatch):
    """B: the restore's H2D copy is queued on the forwards' stream, and HiCache's storage prefetch can evict and
    rewrite that host slot from its IO thread, outside stream order; so the host lock is given back only once an
    event recorded after the copy has completed, at a later scheduling step. The plugin's own host anchors, whose
    only writers are saves queued on that same stream, are unpinned at once."""
    from tailreplay_sglang.cache import anchor_copy

    done = {"copied": False}
    monkeypatch.setattr(anchor_copy, "copy_done_event", lambda: SimpleNamespace(query=lambda: done["copied"]))
    restored = []
    monkeypatch.setattr(anchor_copy, "restore_from_hicache", lambda cache, node, slot: restored.append(node.id))
    unlocked, unpinned = [], []
    lock = SimpleNamespace(to_dec_params=lambda: None)
    cache = SimpleNamespace(inc_host_lock_ref=lambda node_id: lock,
                            dec_host_lock_ref=lambda node_id, params: unlocked.append(node_id))
    host_anchors = SimpleNamespace(pin=lambda node: None, unpin=lambda node: unpinned.append(node.id))
    pool = SimpleNamespace(translate_mamba_indices=lambda index: index, mamba_pool="mamba-pool")
    reqs = [SimpleNamespace(kv=SimpleNamespace(mamba_pool_idx=torch.tensor(i))) for i in (1, 2)]
    host_anchors.restore = lambda node, mamba_pool, slot: restored.append(node.id)
    staged = anchor_copy.StagedAnchors()
    staged.hold_hicache(cache, reqs[0], SimpleNamespace(id=10))
    staged.hold_host(host_anchors, reqs[1], SimpleNamespace(id=20))
    staged.release(cache, host_anchors, admitted=reqs)
    staged.restore_host(host_anchors, pool)
    assert restored == [10, 20] and unpinned == [20] and unlocked == []  # the H2D copy has not run yet
    staged.release(cache, host_anchors, admitted=())  # the next scheduling step, copy still in flight
    assert unlocked == [] and len(staged) == 1
    done["copied"] = True
    staged.release(cache, host_anchors, admitted=())
    assert unlocked == [10] and len(staged) == 0


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


def test_a_state_write_waits_for_its_copy_without_stalling_the_scheduler(monkeypatch):
    """Review D: a state's storage write waits for the event after its host copy. `synchronize()` on it blocked the
    scheduler behind whatever forward was queued before it; now a write whose copy is still running stays queued
    for a later step."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from tailreplay_sglang.cache.hierarchy import TailReplayRadixCache

    monkeypatch.setattr(UnifiedRadixCache, "check_hicache_events", lambda self: None)
    done, written = {"copied": False}, []
    node = SimpleNamespace(id=4, backuped=True, component_data={ComponentType.MAMBA: SimpleNamespace(host_value=1)})
    event = SimpleNamespace(query=lambda: done["copied"],
                            synchronize=lambda: (_ for _ in ()).throw(AssertionError("the scheduler blocked")))
    cache = object.__new__(TailReplayRadixCache)
    cache._state_backups, cache._state_writes = [], [(node, event)]
    cache.tree_core = SimpleNamespace(node_by_id=lambda node_id: node)
    cache.write_backup_storage = written.append
    cache.check_hicache_events()
    assert written == [] and cache._state_writes == [(node, event)]
    done["copied"] = True
    cache.check_hicache_events()
    assert written == [4] and cache._state_writes == []


def test_an_empty_transfer_never_reaches_the_kernel():
    """Review I: sgl-kernel's launcher divides by the number of items; an empty index list copies nothing."""
    from tailreplay_sglang.store.hicache_pool import HiddenHostPool

    def kernel(**kwargs):
        raise AssertionError("the kernel was called with no rows")

    store = SimpleNamespace(hiddens=[torch.zeros(4, 8)], token_ids=torch.zeros(4, 1, dtype=torch.int64))
    empty = torch.empty(0, dtype=torch.int64)
    HiddenHostPool._copy_rows(SimpleNamespace(kernel_copy=kernel), store, store, empty, empty, "kernel")


def test_an_anchor_evicted_before_its_deferred_backup_still_reaches_storage(monkeypatch):
    """Issue 65 class 7: an interval anchor queued for a deferred storage backup (`back_up_state`) and evicted from
    the device before that step: the eviction copies it to the host pool (`_backup_state_to_hicache`) and queues its
    storage write, so the deferred backup stands aside and the next step writes the node, state included."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from tailreplay_sglang.cache.hierarchy import TailReplayRadixCache

    monkeypatch.setattr(UnifiedRadixCache, "check_hicache_events", lambda self: None)
    state = SimpleNamespace(value=torch.tensor([5]), host_value=None)
    node = SimpleNamespace(id=7, backuped=True, write_through_pending_id=None,
                           component_data={ComponentType.MAMBA: state})
    cache = object.__new__(TailReplayRadixCache)
    cache.tree_core = SimpleNamespace(node_by_id=lambda node_id: node)
    cache.cache_controller, cache.enable_storage = object(), True
    cache._state_backups, cache._state_writes, written, backed_up = [], [], [], []
    cache.write_backup_storage = written.append
    cache._execute_and_commit_kv_backup = backed_up.append
    cache.back_up_state(7)  # queued: the node's write-through was issued before the anchor's insert
    host_value = torch.tensor([2])
    entry = SimpleNamespace(device_pool="mamba-pool", host_pool=SimpleNamespace(
        backup_from_device_all_layer=lambda *args: None))
    cache.host_pool_group = SimpleNamespace(alloc=lambda n, pool: host_value, get_entry=lambda pool: entry)
    cache.cache_controller = SimpleNamespace(io_backend="direct", move_indices=lambda host, device: (host, device))
    component = SimpleNamespace(component_type=ComponentType.MAMBA, cache=cache,
                                runtime=SimpleNamespace(forward_stream=None, count_hicache_anchor_backup=lambda: None))
    TailReplayMambaComponent._backup_state_to_hicache(component, node)  # the device pool evicts it first
    state.value = None  # the eviction frees the device slot
    cache.check_hicache_events()
    assert backed_up == [] and written == [7] and state.host_value.tolist() == [2]
    assert cache._state_backups == [] and cache._state_writes == []


def test_the_fla_chunk_path_gets_the_planners_host_cu_seqlens(monkeypatch):
    """H: fla's chunk kernel builds its chunk indices from cu_seqlens, reading them back from the device (one host
    sync per pass) unless it is given `cu_seqlens_cpu`. The planner keeps its host copy on the batch, and the replay
    of a tail long enough for the chunk kernel hands it through."""
    import fla.ops.gated_delta_rule as fla_gdn

    from tailreplay_sglang.cache.request import Match
    from tailreplay_sglang.config import TailReplayConfig
    from tailreplay_sglang.families.base import ReplayBatch
    from tailreplay_sglang.kernels.replay import CHUNK_KERNEL_FROM, gdn_replay
    from tailreplay_sglang.replay import plan

    pool = SimpleNamespace(req_to_token=torch.arange(40).view(2, 20), get_mamba_indices=lambda rows: rows + 10)
    batch = plan(SimpleNamespace(req_to_token_pool=pool), [0, 1],
                 [(0, Match(6, 0, exact=True), "a"), (1, Match(9, 4, exact=True), "b")],
                 TailReplayConfig(enabled=True, exact_budget=100, anchor_interval=0))
    assert isinstance(batch, ReplayBatch) and batch.cu_seqlens_cpu.tolist() == [0, 6, 11]
    assert batch.cu_seqlens_cpu.device.type == "cpu"

    seen = {}

    def chunk(q, k, v, g, beta, initial_state=None, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        seen["cu_seqlens_cpu"] = cu_seqlens_cpu
        return torch.zeros_like(v), initial_state

    monkeypatch.setattr(fla_gdn, "chunk_gated_delta_rule", chunk)
    T, HV, K = 11, 2, 4
    q, k, v = (torch.randn(T, HV, K) for _ in range(3))
    a, b = torch.randn(T, HV), torch.randn(T, HV)
    ssm = torch.zeros(12, HV, K, K)
    gdn_replay(q, k, v, a, b, torch.zeros(HV), torch.zeros(HV), batch.cu_seqlens, torch.tensor([10, 11]), ssm,
               max_seqlen=CHUNK_KERNEL_FROM + 1, cu_seqlens_cpu=batch.cu_seqlens_cpu)
    assert seen["cu_seqlens_cpu"] is batch.cu_seqlens_cpu
