"""Import-time fallbacks for a CPU-only SGLang install, installed at interpreter start by
`sglang_cpu_compat.pth`.

A finder appended to the *end* of `sys.meta_path` is consulted only after every normal finder has failed, so it
changes nothing where the real packages are installed (the GPU route):

- `sgl_kernel` (and submodules) -> `sglang_cpu_compat.sgl_kernel_shim` (pure-torch CPU ops);
- `torchvision` (and submodules), where it is not installed -> a stub. SGLang's config package imports torchvision
  for vision models' preprocessing.

A second finder, placed *first*, runs once before the real torchvision is imported (`TorchvisionOpsFinder`). PyPI's
torchvision is a CUDA build: its Python side (the image transforms SGLang's and transformers' image processors use)
runs on CPU torch, its C++ ops (`_C`) cannot load, and torchvision then handles their absence everywhere but in two
fake-kernel registrations (`torchvision::nms`, `qnms`) that fail at import. The finder defines those two schemas
when `_C` cannot load, so `import torchvision` works; calling the ops raises torchvision's own "Couldn't load
custom C++ ops" error.

It must run in every process (SGLang spawns its scheduler before any plugin can act), hence the .pth file. It is
inert unless SGLang can only run its CPU engine: it serves nothing unless `SGLANG_USE_CPU_ENGINE=1` or the installed
torch is a CPU-only build (so a GPU install missing sgl-kernel fails as stock SGLang does), nor with
`TAILREPLAY_DISABLE_CPU_FALLBACK=1`; see `serves`. It can
never break an import: if setting up the shim fails, the module still loads, as stubs that raise on use, and a
warning says why. This module imports nothing heavy: torch is imported only when `sgl_kernel` is actually requested.
"""

import importlib.abc
import importlib.machinery
import sys
import types
import warnings


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
                          f"{qualname.split('.')[0]} (sglang_cpu_compat CPU fallback)")

    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"__init__": unavailable, "__qualname__": qualname})


class _SglKernelModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        from sglang_cpu_compat.sgl_kernel_shim import UnavailableKernel

        return UnavailableKernel(name)


class _FallbackLoader(importlib.abc.Loader):
    def create_module(self, spec):
        if spec.name.partition(".")[0] == "torchvision":
            return _StubModule(spec.name)
        return _SglKernelModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []  # a package, so any submodule import comes back to this finder
        module.__tailreplay_fallback__ = True
        try:
            _fill(module)
        except Exception as e:  # a changed torch or SGLang must not break `import sglang`: stubs only, and say why
            warnings.warn(f"sglang_cpu_compat CPU fallback: {module.__name__} is served as stubs only ({e!r})",
                          RuntimeWarning, stacklevel=2)


def _fill(module) -> None:
    """The shim's functions and torch ops on a served module."""
    if module.__name__ == "torchvision":
        module.__version__ = "0.0.0+tailreplay.stub"
        return
    from sglang_cpu_compat import sgl_kernel_shim

    if module.__name__ == "sgl_kernel":
        module.__version__ = "0.0.0+tailreplay.cpu"
        module.__dict__.update(sgl_kernel_shim.FUNCTIONS)
        sgl_kernel_shim.register_torch_ops()
    elif module.__name__ == "sgl_kernel.mamba":
        module.__dict__.update(sgl_kernel_shim.MAMBA_FUNCTIONS)
    elif module.__name__ == "sgl_kernel.speculative":
        module.__dict__.update(sgl_kernel_shim.SPECULATIVE_FUNCTIONS)


def serves() -> bool:
    """Whether missing packages are served: on SGLang's CPU engine, or where torch cannot drive a GPU anyway."""
    from sglang_cpu_compat.env import cpu_engine_requested, cpu_fallback_disabled

    return not cpu_fallback_disabled() and (cpu_engine_requested() or _cpu_only_torch())


def _cpu_only_torch() -> bool:
    import torch  # asked only for a missing sgl_kernel / torchvision, which SGLang imports after torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


class CpuFallbackFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        # Other sgl_kernel submodules stay missing: SGLang guards those imports with `except ImportError`.
        served = ("sgl_kernel", "sgl_kernel.mamba", "sgl_kernel.speculative")
        if fullname in served or fullname.partition(".")[0] == "torchvision":
            if serves():
                return importlib.machinery.ModuleSpec(fullname, _FallbackLoader(), is_package=True)
        return None


class TorchvisionOpsFinder(importlib.abc.MetaPathFinder):
    """First on `sys.meta_path`: prepares torch for the real torchvision's import, then lets the normal finders
    find it (always returns None)."""

    prepared = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" and not TorchvisionOpsFinder.prepared and serves():
            TorchvisionOpsFinder.prepared = True
            try:
                _define_torchvision_ops_without_c_extension()
            except Exception as e:  # never break an import: torchvision then fails (or not) as it would without us
                warnings.warn(f"sglang_cpu_compat CPU fallback: torchvision not prepared ({e!r})", RuntimeWarning)
        return None


_torchvision_library = None  # the Library object must outlive the import: dropping it would undefine the ops


def _define_torchvision_ops_without_c_extension() -> None:
    global _torchvision_library
    import glob
    import os

    import torch

    spec = importlib.machinery.PathFinder.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return  # not installed: the end finder serves the stub
    for location in spec.submodule_search_locations:
        for lib in glob.glob(os.path.join(location, "_C*.so")):
            try:
                torch.ops.load_library(lib)  # a CPU build of torchvision loads: it defines its ops itself
                return
            except OSError:
                pass
    _torchvision_library = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        _torchvision_library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def install() -> None:
    if not any(isinstance(f, CpuFallbackFinder) for f in sys.meta_path):
        sys.meta_path.append(CpuFallbackFinder())
    if not any(isinstance(f, TorchvisionOpsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchvisionOpsFinder())
