"""The table of SGLang change points (`tailreplay_sglang/hooks.py`) is the whole picture and matches the installed
SGLang: every target exists, every function resolves, no other module registers a hook, and the runtime's state
reaches its hooks through the object they are bound to. The .pth import hook never breaks an import. The CPU
port's table and import hooks are checked in tests/cpu_compat/test_compat_hooks.py."""

import pkgutil
import types
import warnings
from pathlib import Path

import pytest
import torch

from helpers import count_tensor_calls, hook_registry_callers
from tailreplay_sglang import hooks
from tailreplay_sglang.families import gdn
from tailreplay_sglang.cache.anchors import IntervalAnchors
from tailreplay_sglang.config import TailReplayConfig
from tailreplay_sglang.runtime import TailReplayRuntime

PACKAGE = Path(__file__).resolve().parents[1] / "tailreplay_sglang"
REGISTERED = hooks.ALWAYS + hooks.MODEL_LOADER + hooks.RUNTIME + hooks.INTERVAL_ANCHORS


@pytest.mark.parametrize("hook", REGISTERED, ids=lambda h: h.target.rsplit(".", 2)[-2] + "." + h.kind)
def test_every_target_exists_in_the_installed_sglang(hook):
    owner, attr = hook.target.rsplit(".", 1)
    assert hasattr(pkgutil.resolve_name(owner), attr), hook.target
    assert callable(hooks.resolve(hook)), hook.fn
    assert hook.kind in (*hooks.HOOK_KINDS, "call") and hook.why


@pytest.mark.parametrize("hook", REGISTERED, ids=lambda h: h.fn.rsplit(":", 1)[-1])
def test_a_row_is_bound_exactly_when_its_function_takes_the_runtime(hook):
    import inspect

    first = next(iter(inspect.signature(hooks.resolve(hook)).parameters), None)
    assert hook.bound == (first == "runtime"), hook.fn


def test_no_other_module_registers_a_hook():
    """HookRegistry.register, register_radix_cache_backend and the registries are called from hooks.py only
    (through `hooks.register_table`), so the table cannot fall behind the code."""
    assert set(hook_registry_callers(PACKAGE)) == {"hooks.py"}


def test_the_runtime_hooks_read_their_own_runtime():
    """Two runtimes (two scheduler processes' worth) share nothing: the anchor plan a prefill hook fills is its
    runtime's."""
    config = TailReplayConfig(enabled=True)
    first = TailReplayRuntime(config, interval_anchors=IntervalAnchors(512))
    second = TailReplayRuntime(config, interval_anchors=IntervalAnchors(512))
    first.interval_anchors.by_slot = {3: [(64, 5)]}
    h = torch.arange(2.0).view(1, 2, 1, 1, 1).expand(1, 2, 2, 2, 2)  # the state entering chunks 0 and 1: 0, 1
    kernel = lambda **kw: (None, None, h)  # noqa: E731
    for runtime in (first, second):
        pool = torch.full((8, 2, 2, 2), -1.0)
        gdn.write_anchor_ssm_states(runtime, kernel, initial_state=pool, initial_state_indices=torch.tensor([3]),
                                    cu_seqlens=torch.tensor([0, 100]))
        assert pool[5].eq(1.0 if runtime is first else -1.0).all()
    assert first.interval_anchors.written["ssm"] == {5} and second.interval_anchors.written["ssm"] == set()
    first.count_evicted_anchor()
    assert (first.evicted_anchors, second.evicted_anchors) == (1, 0)
    assert first.pending is not second.pending


@pytest.mark.parametrize("layers", [1, 6])
def test_the_anchor_writers_read_the_batch_layout_once_per_forward(monkeypatch, layers):
    """Each read of a device tensor on the host is a sync on a GPU: a planned prefill forward reads the batch
    layout (bounds, slots, which sequences continue a state) once, whatever the number of recurrent layers whose
    hooks write anchors; an unplanned one reads nothing (issue 38 item 5)."""
    reads = count_tensor_calls(monkeypatch)
    runtime = TailReplayRuntime(TailReplayConfig(enabled=True), interval_anchors=IntervalAnchors(64))
    h = torch.arange(2.0).view(1, 2, 1, 1, 1).expand(1, 2, 2, 2, 2)
    x = torch.ones(4, 100)
    meta = dict(cache_indices=torch.tensor([3]), query_start_loc=torch.tensor([0, 100]),
                has_initial_state=torch.tensor([False]))
    for by_slot, expected in (({}, 0), ({3: [(64, 5)]}, 3)):
        runtime.interval_anchors.use_plan(by_slot)
        reads.clear()
        for _ in range(layers):
            conv_states, ssm_states = torch.zeros(8, 4, 3), torch.zeros(8, 2, 2, 2)
            gdn.write_anchor_conv_states(runtime, lambda x, **kw: x, x, conv_states=conv_states, **meta)
            gdn.write_anchor_ssm_states(runtime, lambda **kw: (None, None, h), initial_state=ssm_states,
                                        initial_state_indices=meta["cache_indices"],
                                        cu_seqlens=meta["query_start_loc"])
        assert len(reads) == expected, reads
        if by_slot:
            assert ssm_states[5].eq(1.0).all() and conv_states[5].eq(1.0).all()  # written, on every layer


def test_committing_or_dropping_planned_anchors_reads_nothing_from_the_device(monkeypatch):
    """GPU path review N7: an anchor's physical slot id is read with the plan's one read and kept, so its commit
    (after the forward, in `process_batch_result`, where a read would wait for the next forward) and its drop read
    nothing."""
    from types import SimpleNamespace

    from tailreplay_sglang.cache.request import state_of

    reads = count_tensor_calls(monkeypatch)
    anchors, freed = IntervalAnchors(64), []
    pool = SimpleNamespace(mamba_allocator=SimpleNamespace(free=freed.append))
    req = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=None, cache_protected_len=0))
    cache = SimpleNamespace(req_to_token_pool=pool)
    for finish in (lambda: anchors.drop(pool, req), lambda: anchors.commit(cache, req)):
        state_of(req).interval_anchors = [(64, torch.tensor([3]), 3), (128, torch.tensor([4]), 4)]
        anchors.written = {"conv": {3, 4}, "ssm": {3, 4}}
        freed.clear()
        finish()
        assert reads == [] and len(freed) == 2 and anchors.written == {"conv": set(), "ssm": set()}


def test_planning_a_batchs_interval_anchors_reads_the_device_once(monkeypatch):
    """GPU path review N7: the plan reads the physical slot ids of every request's own slot and its anchors in one
    read for the batch (a sync on a GPU, where SGLang's mamba allocator hands out device tensors), not one per
    request; each request still gets its own anchors, at its offsets, in the slots it was given."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator

    from tailreplay_sglang.cache.request import state_of

    allocator = MambaSlotAllocator(16, "cpu")
    pool = SimpleNamespace(mamba_allocator=allocator, translate_mamba_indices=lambda t: t + 100)
    tree = SimpleNamespace(mamba_evictable_size=lambda: 0)
    reqs = []
    for extend in (150, 200, 30):  # 2, 3 and no anchors at interval 64
        req = SimpleNamespace(extend_len=extend, prefix_len=10, kv=SimpleNamespace(
            mamba_pool_idx=allocator.alloc(1)[0], holds_mamba=True, req_pool_idx=None, cache_protected_len=0))
        state_of(req).exact = True
        reqs.append(req)
    reads = count_tensor_calls(monkeypatch, ("tolist",))
    anchors = IntervalAnchors(64)
    anchors.plan(reqs, pool, tree, replayed_hits=[])
    monkeypatch.undo()
    assert reads == ["tolist"]
    for req, offsets in zip(reqs, ([64, 128], [64, 128, 192], [])):
        planned = state_of(req).interval_anchors or []
        assert [depth for depth, _, _ in planned] == [10 + off for off in offsets]
        assert all(phys == int(slot) + 100 for _, slot, phys in planned)
        if offsets:
            assert anchors.by_slot[int(req.kv.mamba_pool_idx) + 100] == [(off, p) for off, (_, _, p) in
                                                                        zip(offsets, planned)]


def test_host_anchor_saves_and_restores_read_nothing_from_the_device(monkeypatch):
    """GPU path review N7: a host anchor's device slot stays a device index through its save (on eviction, while
    scheduling) and its restore (in the hit's forward): an `int()` of it waited for every forward queued before. The
    state still round-trips: saved from one slot, restored into another, every layer of every state tensor."""
    from types import SimpleNamespace

    from tailreplay_sglang.cache.anchor_copy import StagedAnchors
    from tailreplay_sglang.cache.host_anchors import HostAnchors

    layers, slots = 3, 6
    cache = SimpleNamespace(conv=[torch.randn(layers, slots, 4, 2)], temporal=torch.randn(layers, slots, 2, 2, 2))
    pool = SimpleNamespace(mamba_cache=cache)
    host = HostAnchors(pool, capacity=2)
    reads = count_tensor_calls(monkeypatch)
    node = object()
    assert host.save(node, pool, torch.tensor([2], dtype=torch.int32))  # mamba slot ids are int32 in SGLang
    staged = StagedAnchors()  # the forward's restore of a hit admitted with this anchor, into its slot 5
    req = SimpleNamespace(kv=SimpleNamespace(mamba_pool_idx=torch.tensor(5, dtype=torch.int32)))
    staged._restores.append(SimpleNamespace(req=req, node=node, hicache=None, unhold_host=lambda h: None))
    staged.restore_host(host, SimpleNamespace(mamba_pool=pool, translate_mamba_indices=lambda t: t))
    monkeypatch.undo()
    assert reads == []
    for t in (*cache.conv, cache.temporal):
        assert torch.equal(t[:, 5], t[:, 2])


def test_interval_anchor_hooks_only_with_interval_anchors():
    """No interval anchors with the paper's budget 0 or interval 0; with them on every device (the prefill's
    per-chunk states exist on every device)."""
    assert TailReplayRuntime.for_scheduler(TailReplayConfig(enabled=True, exact_budget=0)).interval_anchors is None
    assert TailReplayRuntime.for_scheduler(TailReplayConfig(enabled=True, anchor_interval=0)).interval_anchors is None
    anchors = TailReplayRuntime.for_scheduler(TailReplayConfig(enabled=True)).interval_anchors
    assert anchors is not None and anchors.interval == 512


def test_a_changed_entry_point_class_leaves_sglangs_module_importable():
    from tailreplay_sglang import python_api

    module = types.ModuleType("sglang.srt.entrypoints.engine")  # an SGLang without the class we wrap
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        python_api._wrap_or_warn(module, "Engine")
    assert any("Tail-Replay keywords" in str(w.message) for w in caught)


def test_a_hook_that_did_not_apply_stops_the_start_up():
    """SGLang only logs a hook that fails to apply; the runtime refuses to build its cache without every one."""
    runtime = TailReplayRuntime(TailReplayConfig(enabled=True), interval_anchors=IntervalAnchors(512))
    every = {h.target for h in hooks.RUNTIME + hooks.INTERVAL_ANCHORS if h.kind in hooks.HOOK_KINDS}
    hooks.verify_applied(runtime, patched=every)
    missing = sorted(every)[0]
    with pytest.raises(RuntimeError, match="did not apply") as caught:
        hooks.verify_applied(runtime, patched=every - {missing})
    assert missing in str(caught.value)
    anchors_off = TailReplayRuntime(TailReplayConfig(enabled=True, exact_budget=0))
    hooks.verify_applied(anchors_off, patched={h.target for h in hooks.RUNTIME})  # no anchor hooks expected


def test_a_launcher_never_takes_a_config_left_in_its_environment():
    """`TAILREPLAY_CONFIG` written by an earlier launch (an Engine in the same process, an exported shell variable)
    registers no runtime in a process SGLang did not spawn: a launcher takes its config from its own flags."""
    import dataclasses
    import json
    import os
    import subprocess
    import sys

    from tailreplay_sglang.config import ENV_VAR

    code = ("from sglang.srt.plugins.hook_registry import HookRegistry; from tailreplay_sglang import plugin; "
            "plugin.register(); print(sorted(HookRegistry._hooks))")
    env = {**os.environ, ENV_VAR: json.dumps(dataclasses.asdict(TailReplayConfig(enabled=True)))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    registered = out.stdout.strip().splitlines()[-1]
    assert "ServerArgs.from_cli_args" in registered  # the always-on table
    assert "prepare_for_extend" not in registered and "alloc_memory_pool" not in registered
    # Tail-Replay servers in the other tests show the other side: their spawned schedulers do register the runtime


def test_kimi_linears_batched_projection_is_built_in_the_serving_dtype():
    """The BEFORE row on ColumnParallelBatchedLinear.__init__ swaps the checkpoint dtype Kimi Linear passes for the
    dtype SGLang is building the model in (its default dtype then); the other arguments pass through."""
    import torch

    from tailreplay_sglang.models.kimi_linear import batched_linear_in_serving_dtype

    layer = object()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        args, kwargs = batched_linear_in_serving_dtype(layer, 2, 64, 256, dtype=torch.bfloat16, parallel_group="tp")
    finally:
        torch.set_default_dtype(previous)
    assert args == (layer, 2, 64, 256)
    assert kwargs == {"dtype": torch.float32, "parallel_group": "tp"}
