"""Tail-Replay keywords on SGLang's Python entry points: `sglang.Engine(..., enable_tail_replay=True)` and
`sgl.Runtime(..., enable_tail_replay=True)`.

Both build SGLang's `ServerArgs` from their keywords, and `ServerArgs` is a msgspec struct sealed at import from
SGLang's own field namespaces: no plugin can add a field to it. So our keywords are taken off the call before it is
built, validated by the same code and with the same messages as the command-line flags (`plugin.config_from_args`),
and handed on as the launcher hands the flags on: the config through the environment to the spawned scheduler
processes, and the ServerArgs fields Tail-Replay sets (`plugin.hand_off`: `radix_cache_backend`, the linear-attention
prefill backend) given to SGLang.

Why not an SGLang plugin hook: `Engine.__init__` loads plugins only once it is already running, so a hook on it would
miss the first Engine of a process, and `Runtime.__init__` never loads them in the caller's process. The wrapper is
installed instead when SGLang imports the module that defines each class (`install`, run at interpreter start by
`tailreplay_sglang_python_api.pth`, as the CPU fallback is). This module imports nothing heavy at import time.
"""

import argparse
import functools
import importlib.abc
import sys
import warnings

# module defining the entry point -> (class, index of the first ServerArgs positional in its __init__ args)
ENTRY_POINTS = {
    "sglang.srt.entrypoints.engine": ("Engine", 0),
    "sglang.lang.backend.runtime_endpoint": ("Runtime", 2),  # Runtime(log_level, launch_timeout, *server_args)
}
_WRAPPED = "__tailreplay_keywords__"


def take_keywords(kwargs: dict, positional: tuple = ()) -> dict:
    """`kwargs` for SGLang's own call: our keywords removed and validated, the config handed to the schedulers.

    Raises `TailReplayConfigError` (a ValueError) naming the flag, before anything is started. With a prebuilt
    `server_args=`, the keywords are checked against it and its radix cache backend is set to ours.
    """
    from tailreplay_sglang.plugin import KEYWORDS, config_from_args, hand_off

    ours = {k: kwargs.pop(k) for k in KEYWORDS if k in kwargs}
    server_args = kwargs.get("server_args")
    args = _ArgsView(ours, server_args if server_args is not None else kwargs, positional)
    for name, value in hand_off(config_from_args(args), args).items():
        if server_args is None:
            kwargs[name] = value
        else:
            _set_field(server_args, name, value)
    return kwargs


class _ArgsView(argparse.Namespace):
    """What `config_from_args` reads (getattr only): our keywords, then the call's ServerArgs keywords or the
    prebuilt ServerArgs; `model_path` may also come positionally."""

    def __init__(self, ours: dict, rest, positional: tuple):
        super().__init__(**ours)
        self._rest, self._positional = rest, positional

    def __getattr__(self, name):
        rest = self.__dict__["_rest"]
        if isinstance(rest, dict):
            if name == "model_path" and name not in rest and self._positional:
                return self._positional[0]  # ServerArgs' first positional field
            return rest.get(name)
        return getattr(rest, name, None)


def _set_field(server_args, name: str, value) -> None:
    from tailreplay_sglang.config import TailReplayConfigError

    try:
        setattr(server_args, name, value)
    except AttributeError as e:  # SGLang seals a ServerArgs once it is resolved
        raise TailReplayConfigError(f"enable_tail_replay needs a ServerArgs that is not resolved yet ({e})") from None


def wrap_init(cls) -> None:
    """Make `cls(...)` take our keywords. Idempotent."""
    original = cls.__init__
    if getattr(original, _WRAPPED, False):
        return
    is_engine = cls.__name__ == "Engine"
    first_positional = ENTRY_POINTS[cls.__module__][1] if cls.__module__ in ENTRY_POINTS else 0

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if is_engine:
            # What the launcher does before it parses argv: plugins register in this process before our config is
            # in the environment, so this process (the tokenizer manager) is set up as under `launch_server`.
            from sglang.srt.plugins import load_plugins

            load_plugins()
        return original(self, *args, **take_keywords(kwargs, args[first_positional:]))

    setattr(__init__, _WRAPPED, True)
    cls.__init__ = __init__


class _WrapAfterExec(importlib.abc.Loader):
    """The real loader of an entry-point module, then `wrap_init` on the class it defines."""

    def __init__(self, loader, class_name: str):
        self._loader, self._class_name = loader, class_name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _wrap_or_warn(module, self._class_name)

    def __getattr__(self, name):  # get_code, get_source, ... for tools that inspect the loader
        return getattr(self._loader, name)


class EntryPointFinder(importlib.abc.MetaPathFinder):
    """First on `sys.meta_path`; answers only for the entry-point modules, by asking the finders behind it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in ENTRY_POINTS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _WrapAfterExec(spec.loader, ENTRY_POINTS[fullname][0])
                return spec
        return None


def install() -> None:
    if not any(isinstance(f, EntryPointFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, EntryPointFinder())
    for module_name, (class_name, _) in ENTRY_POINTS.items():  # already imported (an install after start-up)
        module = sys.modules.get(module_name)
        if module is not None:
            _wrap_or_warn(module, class_name)


def _wrap_or_warn(module, class_name: str) -> None:
    """Wrap the entry point's constructor; if SGLang changed it beyond recognition, leave SGLang's module as it is
    (the import must never fail because of us) and say that the keywords are unavailable."""
    try:
        wrap_init(getattr(module, class_name))
    except Exception as e:
        warnings.warn(f"tailreplay_sglang: {module.__name__}.{class_name} does not take the Tail-Replay keywords "
                      f"({e!r}); the command-line flags are unaffected", RuntimeWarning, stacklevel=2)
