"""Import-time fallbacks for a CPU-only SGLang install, installed at interpreter start by
`tailreplay_sglang_cpu_fallback.pth`.

A finder appended to the *end* of `sys.meta_path` is consulted only after every normal finder has failed, so it
changes nothing where the real packages are installed (the GPU route):

- `sgl_kernel` (and submodules) -> `tailreplay_sglang.cpu.sgl_kernel_shim` (pure-torch CPU ops);
- `torchvision` (and submodules) -> a stub. SGLang's config package imports torchvision for vision models'
  preprocessing; PyPI's torchvision is a CUDA build that cannot load beside CPU torch, and text models never use it.

It must run in every process (SGLang spawns its scheduler before any plugin can act), hence the .pth file. This
module imports nothing heavy: torch is imported only when `sgl_kernel` is actually requested.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types

DISABLE_ENV = "TAILREPLAY_DISABLE_CPU_FALLBACK"


class _StubModule(types.ModuleType):
    """A module whose every public attribute is a placeholder that raises on use."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")


def _placeholder(qualname: str):
    """A class (so annotations, defaults like `Mode.BICUBIC` and isinstance checks evaluate) that raises on use."""

    def unavailable(*args, **kwargs):
        raise ImportError(f"{qualname} is not available: this CPU install has no working "
                          f"{qualname.split('.')[0]} (tailreplay_sglang CPU fallback)")

    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"__init__": unavailable, "__qualname__": qualname})


class _SglKernelModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        from tailreplay_sglang.cpu.sgl_kernel_shim import UnavailableKernel

        return UnavailableKernel(name)


class _FallbackLoader(importlib.abc.Loader):
    def create_module(self, spec):
        if spec.name.partition(".")[0] == "torchvision":
            return _StubModule(spec.name)
        return _SglKernelModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []  # a package, so any submodule import comes back to this finder
        module.__tailreplay_fallback__ = True
        if module.__name__ == "sgl_kernel":
            from tailreplay_sglang.cpu import sgl_kernel_shim

            sgl_kernel_shim.register_torch_ops()
            module.__version__ = "0.0.0+tailreplay.cpu"
        elif module.__name__ == "sgl_kernel.mamba":
            from tailreplay_sglang.cpu import sgl_kernel_shim

            module.__dict__.update(sgl_kernel_shim.MAMBA_FUNCTIONS)
        elif module.__name__ == "torchvision":
            module.__version__ = "0.0.0+tailreplay.stub"


class CpuFallbackFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        # Other sgl_kernel submodules stay missing: SGLang guards those imports with `except ImportError`.
        if fullname in ("sgl_kernel", "sgl_kernel.mamba") or fullname.partition(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(fullname, _FallbackLoader(), is_package=True)
        return None


def is_active(module_name: str = "sgl_kernel") -> bool:
    """True when `module_name` was served by this fallback rather than the real package."""
    module = sys.modules.get(module_name)
    return bool(getattr(module, "__tailreplay_fallback__", False))


def install() -> None:
    if os.environ.get(DISABLE_ENV) == "1":
        return
    if not any(isinstance(f, CpuFallbackFinder) for f in sys.meta_path):
        sys.meta_path.append(CpuFallbackFinder())
