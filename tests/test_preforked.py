"""The preforker the test servers are forked from (tailreplay_eval/preforked.py): a forked child starts from what a
spawned one starts from (no plugin patch, hook or registry entry of its parent), and a server that fails to start
reports its exit code and its error as a spawned one does."""

import sys
import types
from collections import defaultdict

import pytest

from tailreplay_eval.preforked import ForkedProcess, PluginEffects, Preforker
from tailreplay_eval.server import ServerProcess


class Base:
    def inherited(self):
        return "inherited"


class Target(Base):
    def own(self):
        return "own"


def function():
    return "function"


@pytest.fixture
def fake_targets(monkeypatch):
    """A module with a function and a class (one method its own, one inherited), a second module that imported the
    function by name, and an empty HookRegistry; SGLang's registry functions restored after the test."""
    from sglang.srt.plugins import hook_registry
    from sglang.srt.plugins.hook_registry import HookRegistry

    target = types.ModuleType("tr_fake_target")
    target.function, target.Target = function, Target
    importer = types.ModuleType("tr_fake_importer")
    importer.function = function
    monkeypatch.setitem(sys.modules, target.__name__, target)
    monkeypatch.setitem(sys.modules, importer.__name__, importer)
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(HookRegistry, "_apply_target", HookRegistry.__dict__["_apply_target"])
    monkeypatch.setattr(hook_registry, "_propagate_patch", hook_registry._propagate_patch)
    return target, importer


def test_a_forked_child_takes_back_every_patch_hook_and_registration_of_its_parent(fake_targets):
    import sglang.srt.plugins
    from sglang.srt.mem_cache import registry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    target, importer = fake_targets
    effects = PluginEffects()  # in the launcher, before its plugins load
    for name in ("function", "Target.own", "Target.inherited"):
        HookRegistry.register(f"tr_fake_target.{name}", lambda result, *a, **k: f"patched {result}", HookType.AFTER)
    HookRegistry.apply_hooks()
    registry.register_radix_cache_backend("tr_fake_backend", lambda ctx: None)
    assert (target.function(), importer.function()) == ("patched function", "patched function")
    assert (Target().own(), Target().inherited()) == ("patched own", "patched inherited")

    effects.undo()  # what each forked child runs first
    assert target.function is importer.function is function
    assert (Target().own(), Target().inherited()) == ("own", "inherited")
    assert "inherited" not in Target.__dict__
    assert registry.get_radix_cache_factory("tr_fake_backend") is None
    assert not HookRegistry._hooks and not HookRegistry._patched
    assert sglang.srt.plugins._plugins_loaded is False


@pytest.mark.server
def test_a_forked_server_that_fails_to_start_reports_its_code_and_error(tmp_path, tiny_qwen35):
    if Preforker.default is None:
        pytest.skip("--spawn-servers: no preforker")
    server = ServerProcess(str(tiny_qwen35), ("--tail-replay-ratio", "2"), log_path=tmp_path / "server.log").start()
    assert isinstance(server.proc, ForkedProcess)
    with pytest.raises(RuntimeError, match="server exited with code 2 during start-up") as failure:
        server.wait_healthy(timeout=120)
    assert "--tail-replay-ratio requires --enable-tail-replay" in str(failure.value)  # argparse, as spawned
    server.stop()


def test_the_c_scan_propagates_as_sglang_does(monkeypatch):
    """`preforked.propagate_patch` rebinds exactly what SGLang's `_propagate_patch` rebinds: every global bound to the
    original by identity (under several names, in several modules), not the source module's, not a global merely
    equal to it, and a module whose values cannot be compared (a tensor) does not stop it."""
    import torch
    from sglang.srt.plugins import hook_registry

    from tailreplay_eval.preforked import propagate_patch

    class EqualToAll:
        def __eq__(self, other):
            return True

    def fresh(original):
        source, held, other = (types.ModuleType(f"tr_fake_{name}") for name in ("source", "held", "other"))
        source.function = held.function = held.alias = original
        other.tensor, other.equal = torch.ones(2), EqualToAll()
        for mod in (source, held, other):
            monkeypatch.setitem(sys.modules, mod.__name__, mod)
        return source, held, other

    def original():  # held by the fake modules alone (a module global of this file would be rebound too)
        pass

    results = []
    for propagate in (hook_registry._propagate_patch, propagate_patch):
        source, held, other = fresh(original)
        count = propagate(original, "wrapped", source)
        results.append((count, source.function is original, held.function, held.alias, type(other.equal)))
    assert results[0] == results[1] == (2, True, "wrapped", "wrapped", EqualToAll)
