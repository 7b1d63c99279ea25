"""The commit after a speculative verify, in torch: SGLang's Triton scatters refuse CPU tensors.

After TARGET_VERIFY, each request's last accepted step's recurrent state and conv window are copied from the verify
scratch buffers into its slot, and under extra_buffer the interval-crossing step's into its track slot
(`kernels/ops/mamba/mamba_state_scatter_triton.py::scatter_mamba_states_after_mtp_verify`, called from
`HybridLinearAttnBackend.update_mamba_state_after_mtp_verify`).
"""

from __future__ import annotations

import torch


def scatter_with_mask(dst, src, dst_indices_raw, step_indices_raw, src_indices_raw=None) -> None:
    """For every request i with step_indices_raw[i] >= 0: dst[:, dst_indices_raw[i]] = src[:, row_i, step_i], where
    row_i is src_indices_raw[i] (the request's scratch row) or i. dst [layers, slots, ...]; src [layers, rows, T, ...]
    (the conv windows' may be an overlapping strided view: read through its strides). Also the REPLACE of
    `fused_conv_window_scatter_with_mask` (KDA's fused accept), which has these arguments."""
    if dst is None or src is None or dst.numel() == 0 or step_indices_raw.numel() == 0:
        return
    steps = step_indices_raw.long()
    rows = torch.arange(steps.shape[0]) if src_indices_raw is None else src_indices_raw.long()
    valid = steps >= 0
    if not bool(valid.any()):
        return
    dst[:, dst_indices_raw.long()[valid]] = src[:, rows[valid], steps[valid]].to(dst.dtype)


def scatter_mamba_states_after_mtp_verify(mamba_caches, state_indices_tensor, last_correct_step_indices,
                                          mamba_track_indices, mamba_steps_to_track, src_indices_raw=None) -> None:
    """REPLACE of SGLang's function of this name (same arguments): SSM states and every conv type, accepted step and
    track step."""
    commits = [(state_indices_tensor, last_correct_step_indices)]
    if mamba_track_indices is not None:
        assert mamba_steps_to_track is not None
        commits.append((mamba_track_indices, mamba_steps_to_track))
    for dst_indices, steps in commits:
        scatter_with_mask(mamba_caches.temporal, mamba_caches.intermediate_ssm, dst_indices, steps, src_indices_raw)
        for conv, window in zip(mamba_caches.conv, mamba_caches.intermediate_conv_window):
            scatter_with_mask(conv, window, dst_indices, steps, src_indices_raw)

