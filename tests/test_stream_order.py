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
