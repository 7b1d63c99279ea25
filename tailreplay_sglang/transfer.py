"""Host-to-device transfer of a cache hit (FA KV, tail hiddens, tail token ids), serialized or overlapped.

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

Host tensors should be pinned (`pin`); a pageable source makes a "non-blocking" copy synchronous and the overlap
silently disappears, so mode "ovl" refuses one. Callers may drop a host tensor right after `copy`: torch's pinned
allocator (which `pin` uses) records the copy and keeps the block until it has landed.
"""

import torch

MODES = ("ser", "ovl")


def pin(t: torch.Tensor) -> torch.Tensor:
    """Page-locked copy of a host tensor when CUDA is present (async H2D needs it); the tensor itself otherwise."""
    return t.pin_memory() if torch.cuda.is_available() and not t.is_cuda else t


class HostToDevice:
    """Copies host tensors to `device`, serialized ("ser") or overlapped with compute ("ovl"); see the module doc."""

    def __init__(self, device, mode: str = "ovl"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" -> "cuda:N", so device checks compare
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.mode = mode
        overlapped = mode == "ovl" and self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if overlapped else None
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


def copy_all_blocking(host: dict, device) -> dict:
    """Reference: every tensor moved with a plain blocking `.to(device)`; what `HostToDevice` must reproduce."""
    return {key: t.to(device) for key, t in host.items()}
