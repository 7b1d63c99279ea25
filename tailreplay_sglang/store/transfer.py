"""Host <-> device transfers of Tail-Replay: a hit's H2D load (serialized or overlapped), the store's D2H write-back.

The paper's second replay optimization: the replay never reads the FA KV, so the KV can travel host -> device on a
separate copy stream while the compute stream replays the GDN tail; the compute stream waits for one FA layer's KV
only right before that layer's attention. `HostToDevice` is that stream logic, shared by the server and by
`bench/ttft_gpu.py` (it imports torch only, no SGLang):

    h2d = HostToDevice("cuda", mode="ovl")
    tail = h2d.copy("tail", tail_host)              # launch every copy first, in the order they are needed
    kv = {i: h2d.copy(i, kv_host[i]) for i in fa_layers}
    h2d.wait("tail"); replay(tail)                  # the compute stream waits for the tail only
    for i in fa_layers: h2d.wait(i); attend(kv[i])  # ... and for layer i's KV right before layer i

- mode "ovl" on CUDA: copies run on the copy stream, one event per key; `wait(key)` makes the current stream wait
  for that event only.
- mode "ser" on CUDA: copies are queued on the current stream itself, so everything queued after them (the replay)
  runs after all copies: the serialized baseline (H2D-SER). `wait` has nothing to do.
- a tensor already on the target device (CPU runs, CPU tests): `copy` returns it as it is and `wait` does nothing,
  so CPU callers run the same code.

`DeviceToHostWriteBack` is the other direction: the hidden store in host memory receives every forward's new
hiddens on a copy stream, into pinned staging buffers, and applies them to the store (a host-side scatter) once the
copy has landed, in submission order, so the forward never waits for it. On a CPU the apply happens at once.

Host tensors should be pinned (`pin`); a pageable source makes a "non-blocking" copy synchronous and the overlap
silently disappears, so mode "ovl" refuses one. Callers may drop a host tensor right after `copy`: torch's pinned
allocator (which `pin` uses) records the copy and keeps the block until it has landed.
"""

import collections

import torch

from tailreplay_sglang.config import H2D_MODES


def pin(t: torch.Tensor) -> torch.Tensor:
    """Page-locked copy of a host tensor when CUDA is present (async H2D needs it); the tensor itself otherwise."""
    return t.pin_memory() if torch.cuda.is_available() and not t.is_cuda else t


# The overlapped H2D copy stream of each device, drawn once per process (`copy_stream`)
_COPY_STREAMS: dict = {}
# PyTorch's pool holds 32 streams per priority and device; a redraw past that many cannot find another
_POOL_STREAMS = 32


def copy_stream(device: torch.device):
    """The overlapped H2D copies' stream on `device`, the same for every replay pass and never the current (the
    forwards') stream. PyTorch hands `torch.cuda.Stream()` out round-robin from a fixed pool, so a stream drawn per
    pass could alias the forwards' stream and serialize the copies behind the replay (GPU path review K). SGLang
    redraws its own schedule stream the same way (`scheduler.py`)."""
    current = torch.cuda.current_stream(device)
    stream = _COPY_STREAMS.get(device)
    draws = 0
    while stream is None or stream == current:
        if draws == _POOL_STREAMS:
            raise RuntimeError(f"no CUDA stream on {device} other than the current one")
        stream, draws = torch.cuda.Stream(device), draws + 1
    _COPY_STREAMS[device] = stream
    return stream


class HostToDevice:
    """Copies host tensors to `device`, serialized ("ser") or overlapped with compute ("ovl"); see the module doc."""

    def __init__(self, device, mode: str = "ovl"):
        if mode not in H2D_MODES:
            raise ValueError(f"mode must be one of {H2D_MODES}, got {mode!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" -> "cuda:N", so device checks compare
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.mode = mode
        overlapped = mode == "ovl" and self.device.type == "cuda"
        self.stream = copy_stream(self.device) if overlapped else None
        self.events: dict = {}

    def copy(self, key, host: torch.Tensor) -> torch.Tensor:
        """Queue `host` -> device; returns the device tensor, readable on the current stream after `wait(key)`."""
        if host.device == self.device:
            return host
        if self.device.type != "cuda":  # e.g. a CUDA tensor brought back to the CPU: plain blocking copy
            return host.to(self.device)
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)  # allocated on the current stream
        if host.numel() == 0:  # nothing to move (and an empty view's pinnedness is not well defined)
            return out
        if self.stream is None:
            return out.copy_(host, non_blocking=True)
        if not host.is_pinned():
            raise ValueError(f"overlapped copy of {key!r} needs a pinned host tensor (see transfer.pin)")
        # `out` may be a block the current stream freed with kernels still queued on it: let those finish first.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out.copy_(host, non_blocking=True)
            self.events[key] = torch.cuda.Event()
            self.events[key].record(self.stream)
        # When `out` is freed, the allocator must not hand the block out again before the copy has landed.
        out.record_stream(self.stream)
        return out

    def wait(self, key) -> None:
        """Make the current stream wait for the copy of `key` (and nothing else)."""
        event = self.events.get(key)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def wait_all(self) -> None:
        for key in self.events:
            self.wait(key)


class DeviceToHostWriteBack:
    """Asynchronous device -> host copies whose host-side effect (`apply`) runs in submission order once landed.

    `submit(apply, *tensors)` copies `tensors` to pinned host buffers on a copy stream (after what the current stream
    has queued, which produced them) and later calls `apply(*host_tensors)`. `poll()` applies every landed copy,
    `drain()` waits for all: a reader of what `apply` writes calls `drain()` first. Order matters for a store whose
    slots are reused: a later write to a slot must land after an earlier one, so a copy that has landed still waits
    for every copy submitted before it.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._queue: collections.deque = collections.deque()

    def submit(self, apply, *tensors: torch.Tensor) -> None:
        if self.stream is None:  # host == device: the synchronous path, same effect
            apply(*tensors)
            return
        event, staged = self._launch(tensors)
        self._queue.append((event, apply, staged))
        self.poll()

    def _launch(self, tensors) -> tuple:
        """Queue the copies on the copy stream; returns (event recorded after them, pinned host buffers)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward produced `tensors`
        with torch.cuda.stream(self.stream):
            staged = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, t in zip(staged, tensors):
                host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # the forward may free `t` before the copy has read it
            event = torch.cuda.Event()
            event.record(self.stream)
        return event, staged

    def poll(self) -> None:
        while self._queue and self._queue[0][0].query():
            _, apply, staged = self._queue.popleft()
            apply(*staged)

    def drain(self) -> None:
        while self._queue:
            event, apply, staged = self._queue.popleft()
            event.synchronize()
            apply(*staged)

    def __len__(self) -> int:
        return len(self._queue)


def copy_all_blocking(host: dict, device) -> dict:
    """Reference: every tensor moved with a plain blocking `.to(device)`; what `HostToDevice` must reproduce."""
    return {key: t.to(device) for key, t in host.items()}
