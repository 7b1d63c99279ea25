"""The CPU port's table of SGLang change points (`sglang_cpu_compat/hooks.py`) matches the installed SGLang: every
target exists and every function resolves; it registers through the plugin's `register_table` only; its .pth import
hooks serve only SGLang's CPU engine and never break an import."""

import inspect
import pkgutil
import types
import warnings
from pathlib import Path

import pytest

from helpers import hook_registry_callers
from sglang_cpu_compat import hooks
from tailreplay_sglang import hooks as plugin_hooks

PACKAGE = Path(hooks.__file__).resolve().parent


@pytest.mark.parametrize("hook", hooks.CPU_ENGINE, ids=lambda h: h.target.rsplit(".", 2)[-2] + "." + h.kind)
def test_every_target_exists_in_the_installed_sglang(hook):
    owner, attr = hook.target.rsplit(".", 1)
    assert hasattr(pkgutil.resolve_name(owner), attr), hook.target
    assert callable(plugin_hooks.resolve(hook)), hook.fn
    assert hook.kind in (*plugin_hooks.HOOK_KINDS, "call") and hook.why


@pytest.mark.parametrize("hook", hooks.CPU_ENGINE, ids=lambda h: h.fn.rsplit(":", 1)[-1])
def test_no_row_is_bound_to_a_runtime(hook):
    """The port has no runtime: no row is `bound`, and no function takes one."""
    first = next(iter(inspect.signature(plugin_hooks.resolve(hook)).parameters), None)
    assert not hook.bound and first != "runtime", hook.fn


@pytest.mark.parametrize("hook", hooks.ELSEWHERE, ids=lambda h: h.fn.rsplit(":", 1)[-1])
def test_the_import_hooks_are_what_the_pth_file_installs(hook):
    """Each listed import hook resolves, and the .pth it names installs it at interpreter start."""
    pth, _, fn = hook.fn.partition(" -> ")
    assert pkgutil.resolve_name(fn) and hook.kind == "import" and hook.why
    assert "sglang_cpu_compat.fallback" in (PACKAGE.parent / pth).read_text()


def test_no_module_of_the_port_registers_a_hook_itself():
    """HookRegistry.register is reached only through the plugin's `hooks.register_table`, from the port's table."""
    assert hook_registry_callers(PACKAGE) == []


@pytest.mark.parametrize("cpu_engine, cpu_torch, disabled, served", [
    ("1", False, None, True),  # SGLang's CPU engine
    (None, True, None, True),  # a CPU-only torch: SGLang can run nothing else
    (None, False, None, False),  # a GPU install missing sgl-kernel fails as stock does
    ("1", True, "1", False),  # switched off
])
def test_cpu_fallback_serves_only_for_sglangs_cpu_engine(monkeypatch, cpu_engine, cpu_torch, disabled, served):
    from sglang_cpu_compat import fallback

    for name, value in (("SGLANG_USE_CPU_ENGINE", cpu_engine), ("TAILREPLAY_DISABLE_CPU_FALLBACK", disabled)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(fallback, "_cpu_only_torch", lambda: cpu_torch)
    finder = fallback.CpuFallbackFinder()
    for name in ("sgl_kernel", "sgl_kernel.mamba", "torchvision.transforms"):
        assert (finder.find_spec(name) is not None) is served, name
    assert finder.find_spec("numpy") is None


def test_a_failing_shim_leaves_a_stub_module_and_a_warning(monkeypatch):
    from sglang_cpu_compat import fallback

    def broken(module):
        raise RuntimeError("torch changed")

    monkeypatch.setattr(fallback, "_fill", broken)
    module = fallback._FallbackLoader().create_module(types.SimpleNamespace(name="sgl_kernel"))
    module.__name__ = "sgl_kernel"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback._FallbackLoader().exec_module(module)
    assert any("stubs only" in str(w.message) for w in caught)
    with pytest.raises(NotImplementedError):
        module.anything()
