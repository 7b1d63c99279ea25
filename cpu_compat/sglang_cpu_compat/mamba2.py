"""Mamba2's ops for SGLang's CPU engine: what `layers/attention/mamba/mamba.py` binds only on
CUDA, NPU and XPU, so that on a CPU the first Mamba2 forward fails with "name 'causal_conv1d_fn_triton' is not
defined" (Nemotron-H, Granite-4.0-H, Falcon-H1 and every other `MambaMixer2` model).

`install` (a `call` row of `hooks.CPU_ENGINE`) binds the mixer module's six kernel names to torch bodies: the
causal conv (both of SGLang's spellings: the prefill conv is the one the GDN path gets from `sgl_kernel_shim`,
whose argument order is the same) and the SSD scan and decode update (`ops/ssd.py`), in the argument order and return
shapes of SGLang's Triton kernels.
"""

import bisect

import torch

from sglang_cpu_compat.ops import ssd
from sglang_cpu_compat.sgl_kernel_shim import causal_conv1d_fn_cpu as causal_conv1d_fn
from tailreplay_sglang.ops import conv

MIXER_MODULE = "sglang.srt.layers.attention.mamba.mamba"


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, **unused):
    if unused.get("intermediate_conv_window") is not None:
        raise NotImplementedError("CPU causal_conv1d_update: speculative decoding is not supported")
    return conv.causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, chunk_indices=None, chunk_offsets=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")), out=None, return_final_states=False,
                              return_varlen_states=False, return_intermediate_states=False, state_dtype=None,
                              return_track_states=False, track_seq_idx=None, track_end_locs=None):
    """SGLang's `mamba_chunk_scan_combined` (batch 1, packed): fills `out` and returns what the flags ask for.

    The per-chunk states are one grid over the packed batch, as SGLang's Triton scan lays them out and its
    extra_buffer tracking reads them (`h[end // chunk_size]`, `prefill_track_metadata.py`): row k is the state at
    packed position k * chunk_size of the sequence holding that position (its initial state where it starts
    there). Tracked ends are packed positions too."""
    if x.shape[0] != 1:
        raise NotImplementedError("CPU mamba_chunk_scan_combined: packed batch 1 only (what SGLang passes)")
    T = x.shape[1]
    cu = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    grid = [_in_sequence(cu, p) for p in range(0, T, chunk_size)]
    tracked = []
    if return_track_states and track_end_locs is not None and track_end_locs.numel():
        tracked = [(s, e - cu[s]) for s, e in zip(track_seq_idx.tolist(), track_end_locs.tolist())]
    dt_p = ssd.process_dt(dt[0], dt_bias, dt_softplus, tuple(dt_limit))
    y, finals, at = ssd.chunk_scan(x[0], dt_p, A, B[0], C[0], chunk_size, D, initial_states, cu_seqlens,
                                      grid + tracked)
    chunks, track = at[:len(grid)], (at[len(grid):] if tracked else None)
    if z is not None:
        y = y * torch.nn.functional.silu(z[0].float())
    if out is not None:
        out.copy_(y.unsqueeze(0).view_as(out).to(out.dtype))
    dtype = state_dtype or C.dtype
    states = chunks.unsqueeze(0).to(dtype)
    finals = finals.to(dtype)
    if return_track_states:
        return states, finals, None if track is None else track.unsqueeze(0).to(dtype)
    rest = []
    if return_intermediate_states:
        rest.append(states)
    if return_final_states:
        rest.append(finals[-1:])
    if return_varlen_states:
        rest.append(finals)
    if out is None:
        rest.insert(0, y.unsqueeze(0).to(x.dtype))
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)


def _in_sequence(cu: list[int], position: int) -> tuple[int, int]:
    """(sequence, offset within it) of a packed position."""
    seq = bisect.bisect_right(cu, position) - 1
    return seq, position - cu[seq]


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, out=None, **spec):
    if spec.get("intermediate_states_buffer") is not None or spec.get("disable_state_update"):
        raise NotImplementedError("CPU selective_state_update: speculative decoding is not supported")
    return ssd.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, out)


def install() -> None:
    """`call` row: bind the mixer module's kernel names (they are absent on a CPU; the Triton ones cannot run)."""
    import importlib

    mixer = importlib.import_module(MIXER_MODULE)
    mixer.causal_conv1d_fn = mixer.causal_conv1d_fn_triton = causal_conv1d_fn
    mixer.causal_conv1d_update = mixer.causal_conv1d_update_triton = causal_conv1d_update
    mixer.mamba_chunk_scan_combined = mamba_chunk_scan_combined
    mixer.selective_state_update = selective_state_update
