"""Speculative decoding's target verify for GDN layers, in pure torch (what SGLang's Triton kernels do on a GPU).

A verify pass runs the `T` draft tokens of each request (a chain for NEXTN, a tree for NGRAM) through the layer
*without* committing: every step's conv window and recurrent state go to per-request scratch buffers
(`intermediate_conv_window` [slots, T, dim, width - 1] and `intermediate_ssm` [slots, T, HV, V, K]), and
`commit_mamba_states_after_verify` later copies the last accepted step's into the request's slot
(`sglang/srt/speculative/spec_utils.py`). In a tree, token i continues from its parent's state, not from token i - 1.

Semantics follow `sglang/kernels/ops/mamba/causal_conv1d_triton.py::_causal_conv1d_update_kernel` and
`sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py` (disable_state_update, cache_steps,
retrieve_parent_token), step for step; `tests/cpu_compat/test_spec_verify.py` checks both against a float64 replay of
each draft path from the committed state.
"""

from __future__ import annotations

import torch

from tailreplay_sglang.ops.conv import _activate
from sglang_cpu_compat.ops import kda
from tailreplay_sglang.ops.gdn import _seq_bounds, recurrent_inputs


def draft_parents(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """[B, T] parent index of every draft token (token 0, the last verified token, is the root and gets 0), from
    EAGLE's first-child / next-sibling lists (-1: none), as the conv kernel derives them."""
    parents = torch.zeros_like(next_token)
    for b in range(next_token.shape[0]):
        for i in range(next_token.shape[1]):
            child, sibling = int(next_token[b, i]), int(next_sibling[b, i])
            if child != -1:
                parents[b, child] = i
            if sibling != -1:
                parents[b, sibling] = parents[b, i]
    return parents


def _ancestry(token: int, parents: torch.Tensor | None, width: int) -> list[int]:
    """The `width` inputs token `token` convolves, newest first: itself, its parent, ... ; negative numbers -1, -2, ...
    name the committed conv state's newest, second newest, ... column."""
    path, current = [], token
    for _ in range(width):
        path.append(current)
        if current > 0:
            current = int(parents[current]) if parents is not None else current - 1
        else:
            current -= 1
    return path


def causal_conv1d_verify(x, conv_states, weight, bias, activation, conv_state_indices, intermediate_conv_window,
                         intermediate_state_indices, retrieve_next_token=None, retrieve_next_sibling=None,
                         retrieve_parent_token=None):
    """x: [B, dim, T] draft inputs; conv_states [slots, dim, width - 1]. Returns y [B, dim, T].

    Writes each step's window (the `width - 1` newest inputs of its path) to
    intermediate_conv_window[intermediate_state_indices[b], step], shifts the slot's conv state by T as the Triton
    kernel does (the commit overwrites it with the accepted step's window), and fills retrieve_parent_token."""
    batch, dim, steps = x.shape
    width = weight.shape[1]
    tree = retrieve_next_token is not None
    parents = draft_parents(retrieve_next_token, retrieve_next_sibling) if tree else None
    y = torch.empty_like(x)
    w, b = weight.float(), None if bias is None else bias.float()
    for seq in range(batch):
        slot = int(conv_state_indices[seq])
        if slot < 0:
            continue
        history = conv_states[slot].float()  # [dim, width - 1], oldest first
        inputs = x[seq].float()
        seq_parents = parents[seq] if tree else None
        inter = int(intermediate_state_indices[seq])
        for step in range(steps):
            path = _ancestry(step, seq_parents, width)
            window = torch.stack([inputs[:, i] if i >= 0 else history[:, width - 1 + i] for i in reversed(path)], -1)
            out = (window * w).sum(-1) + (0 if b is None else b)
            y[seq, :, step] = _activate(out, activation).to(x.dtype)
            if intermediate_conv_window is not None and inter >= 0:
                intermediate_conv_window[inter, step] = window[:, 1:].to(intermediate_conv_window.dtype)
        conv_states[slot] = torch.cat([history, inputs], -1)[:, -(width - 1):].to(conv_states.dtype)
        if tree and retrieve_parent_token is not None:
            retrieve_parent_token[seq, :steps] = parents[seq, :steps].to(retrieve_parent_token.dtype)
    return y


def recurrent_gated_delta_rule_verify(A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices,
                                      cu_seqlens, intermediate_states_buffer, intermediate_state_indices,
                                      retrieve_parent_token=None, disable_state_update=True,
                                      use_qk_l2norm_in_kernel=False, softplus_beta=1.0, softplus_threshold=20.0,
                                      scale=None):
    """The GDN delta rule over each request's draft tokens (q, k [1, N, H, K]; v [1, N, HV, V]; a, b [N, HV]).

    Step s of request n starts from the committed state (s = 0) or, in a tree, from its parent's intermediate state,
    and stores its state at intermediate_states_buffer[intermediate_state_indices[n], s]. The slot's state is left
    alone under disable_state_update (the verify default). Returns o: [1, N, HV, V]."""
    qf, kf, g, beta = recurrent_inputs(A_log, dt_bias, q, k, v, a, b, use_qk_l2norm_in_kernel, softplus_beta,
                                       softplus_threshold, scale)
    return _verify_steps(qf, kf, v, g.unsqueeze(-1), beta, initial_state_source, initial_state_indices, cu_seqlens,
                         intermediate_states_buffer, intermediate_state_indices, retrieve_parent_token,
                         disable_state_update)


def recurrent_kda_verify(A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices, cu_seqlens,
                         intermediate_states_buffer, intermediate_state_indices, retrieve_parent_token=None,
                         disable_state_update=True, use_qk_l2norm_in_kernel=False, lower_bound=None, scale=None):
    """KDA's verify (Ling-3.0's MTP draft): `recurrent_gated_delta_rule_verify` with KDA's per-key-channel decay and
    sigmoid beta, read as the decode step reads them (`ops.kda.recurrent_inputs`)."""
    qf, kf, g, beta = kda.recurrent_inputs(A_log, dt_bias, q, k, v, a, b, use_qk_l2norm_in_kernel, lower_bound, scale)
    return _verify_steps(qf, kf, v, g, beta, initial_state_source, initial_state_indices, cu_seqlens,
                         intermediate_states_buffer, intermediate_state_indices, retrieve_parent_token,
                         disable_state_update)


def _verify_steps(qf, kf, v, g, beta, initial_state_source, initial_state_indices, cu_seqlens,
                  intermediate_states_buffer, intermediate_state_indices, retrieve_parent_token, disable_state_update):
    """The delta rule over each request's draft tokens: float32 q (scaled), k [N, HV, K], log decays g [N, HV, 1]
    (GDN) or [N, HV, K] (KDA, per key channel), beta [N, HV]; states as `recurrent_gated_delta_rule_verify` says."""
    HV, K = v.shape[2], kf.shape[-1]
    vf = v[0].float()
    o = torch.zeros(v.shape[1:], dtype=torch.float32)
    for seq, (start, end) in enumerate(_seq_bounds(cu_seqlens, v.shape[1])):
        slot = int(initial_state_indices[seq])
        inter = int(intermediate_state_indices[seq]) if intermediate_state_indices is not None else -1
        state = initial_state_source[slot].float() if slot >= 0 else vf.new_zeros(HV, v.shape[-1], K)
        for step, t in enumerate(range(start, end)):
            if retrieve_parent_token is not None and step > 0 and inter >= 0:
                state = intermediate_states_buffer[inter, int(retrieve_parent_token[seq, step])].float()
            state = state * g[t].exp().unsqueeze(-2)
            delta = beta[t][:, None] * (vf[t] - (state @ kf[t].unsqueeze(-1)).squeeze(-1))
            state = state + delta.unsqueeze(-1) * kf[t].unsqueeze(-2)
            o[t] = (state @ qf[t].unsqueeze(-1)).squeeze(-1)
            if intermediate_states_buffer is not None and inter >= 0:
                intermediate_states_buffer[inter, step] = state.to(intermediate_states_buffer.dtype)
        if not disable_state_update and slot >= 0:
            initial_state_source[slot] = state.to(initial_state_source.dtype)
    return o.unsqueeze(0).to(v.dtype)

