"""One Mamba2 mixer over the packed replay tails (Nemotron-H, Granite-4.0-H), through the model's own projections, conv weights,
norm and SGLang's kernel entry points, with its conv and SSM states read from and written to the requests' slots.

The kernels are the names SGLang's mixer module binds (`layers/attention/mamba/mamba.py`): its Triton causal conv
and SSD scan on a GPU, the torch bodies of `cpu/mamba2.py` on a CPU. Every tail starts from its slot's state (an
anchor's copy, or the cleared state of a zero-init tail), so all rows have an initial state.
"""

import torch

from tailreplay_sglang.ops.ssd import process_dt


def _kernels():
    from sglang.srt.layers.attention.mamba import mamba

    return mamba


def _chunk_metadata(cu_seqlens: torch.Tensor, chunk_size: int, total: int):
    """seq_idx, chunk_indices and chunk_offsets of the packed tails, as SGLang's Mamba2 metadata computes them for
    a prefill whose sequences have initial states."""
    from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata

    lens = cu_seqlens.diff()
    seq_idx = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32, device=cu_seqlens.device), lens)
    chunk_indices, chunk_offsets = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(cu_seqlens, chunk_size,
                                                                                             total)
    return seq_idx.unsqueeze(0), chunk_indices, chunk_offsets


def replay_mixer(mixer, cache, h: torch.Tensor, cu_seqlens: torch.Tensor, tail_lens: list[int],
                 mamba_slots: torch.Tensor, chunk_size: int, state_only: bool):
    """h: the normed layer input [T, hidden]. Returns (the mixer's output before any TP sum, or None when only the
    states were needed; the log-decays dt * A [T, heads] for the survival bound)."""
    kernels = _kernels()
    tp = mixer.tp_size
    heads, head_dim = mixer.num_heads // tp, mixer.head_dim
    groups_state = mixer.groups_ssm_state_size // tp
    T = h.shape[0]
    projected, _ = mixer.in_proj(h)
    gate, xbc, dt = torch.split(projected, [mixer.intermediate_size // tp, mixer.conv_dim // tp, heads], dim=-1)
    cu = cu_seqlens.to(torch.int32)
    slots = mamba_slots.to(torch.int32)
    weight = mixer.conv1d.weight.view(mixer.conv1d.weight.size(0), mixer.conv1d.weight.size(2))
    xbc = kernels.causal_conv1d_fn_triton(
        xbc.transpose(0, 1), weight, mixer.conv1d.bias, activation=mixer.activation, conv_states=cache.conv[0],
        has_initial_state=torch.ones(len(tail_lens), dtype=torch.bool, device=h.device), cache_indices=slots,
        query_start_loc=cu, seq_lens_cpu=tail_lens).transpose(0, 1)[:T]
    x, B, C = torch.split(xbc, [mixer.intermediate_size // tp, groups_state, groups_state], dim=-1)
    seq_idx, chunk_indices, chunk_offsets = _chunk_metadata(cu, chunk_size, T)
    ssm = cache.temporal
    out = torch.empty(T, heads * head_dim, dtype=h.dtype, device=h.device)
    groups = mixer.n_groups // tp
    finals = kernels.mamba_chunk_scan_combined(
        x.reshape(1, T, heads, head_dim), dt.unsqueeze(0), mixer.A, B.reshape(1, T, groups, -1),
        C.reshape(1, T, groups, -1), chunk_size=chunk_size, D=mixer.D, z=None, dt_bias=mixer.dt_bias,
        seq_idx=seq_idx, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, cu_seqlens=cu,
        initial_states=ssm[mamba_slots], return_varlen_states=True, dt_softplus=True,
        out=out.view(1, T, heads, head_dim), state_dtype=ssm.dtype)
    ssm[mamba_slots] = finals.to(ssm.dtype)
    log_decay = process_dt(dt, mixer.dt_bias, dt_softplus=True) * mixer.A.float()
    if state_only:
        return None, log_decay
    return mixer.out_proj(mixer.norm(out, gate))[0], log_decay
