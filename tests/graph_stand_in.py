"""A CUDA graph's contract on a CPU, for the contract tests of what Tail-Replay runs inside captured graphs.

`capture(fn)` runs `fn` once, as a capture does, recording every aten op it launches with the tensors it launched
them on; `replay()` launches exactly those ops again on the same tensors (their memory stands for a graph's fixed
addresses) and nothing else: any Python in `fn` (a hook, a queue, a host-side apply) runs at capture only. Capture
refuses what a CUDA graph cannot hold: an op that reads a value back to the host (`.item()`, a boolean mask's
data-dependent shape) and a write to memory that is neither one of the device buffers it was given nor allocated
inside the capture (e.g. a host table). `is_capturing` is what `torch.cuda.is_current_stream_capturing` says on a GPU.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Ops that need the value of a device tensor on the host: a CUDA graph capture fails on them.
SYNCING_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
              torch.ops.aten.masked_select.default, torch.ops.aten.item.default}


class GraphCaptureError(RuntimeError):
    pass


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class GraphStandIn:
    def __init__(self, device_tensors: list[torch.Tensor]):
        self._owned = {_storage(t) for t in device_tensors}
        self._ops: list[tuple] = []
        self.capturing = False

    def is_capturing(self) -> bool:
        return self.capturing

    def capture(self, fn) -> None:
        self.capturing = True
        try:
            with _Recorder(self):
                fn()
        finally:
            self.capturing = False

    def replay(self) -> None:
        for func, args, kwargs, out in self._ops:
            result = func(*args, **kwargs)
            for kept, new in zip(_tensors(out), _tensors(result)):
                if kept.data_ptr() != new.data_ptr():  # an out-of-place op: its result lands where capture put it
                    kept.copy_(new)

    def _record(self, func, args, kwargs):
        if func in SYNCING_OPS:
            raise GraphCaptureError(f"{func} reads a device value on the host inside a captured graph")
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            target = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            for t in _tensors(target):
                if _storage(t) not in self._owned:
                    raise GraphCaptureError(f"{func} writes memory that is not the graph's (a host table?)")
        inputs = {_storage(t) for t in _tensors((args, kwargs))}
        out = func(*args, **kwargs)
        self._owned |= {_storage(t) for t in _tensors(out) if _storage(t) not in inputs}  # allocated here
        self._ops.append((func, args, kwargs, out))
        return out


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: GraphStandIn):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.graph._record(func, args, kwargs or {})
