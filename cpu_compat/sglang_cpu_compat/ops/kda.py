"""Kimi Delta Attention (KDA) in pure torch: a chunked prefill and the one-token decode update.

KDA is Gated DeltaNet with a per-channel decay: the state `S` ([HV, V, K], value-major as SGLang's pool stores it)
decays along its key channels, `S_t = S_{t-1} diag(exp(g_t))`, then takes the delta-rule write
`S_t += beta_t (v_t - S_t k_t) k_t^T`, and `o_t = S_t q_t`. Layout and pool handling follow the plugin's `ops.gdn`
(packed `[1, T, H, d]` tokens, `cu_seqlens`, states read and written at slot indices), whose scan helpers and the gate
(`ops.kda.kda_gate`, which the plugin's KDA replay shares) are used here; KDA has as many key as value heads.
"""

import torch
import torch.nn.functional as F

from tailreplay_sglang.ops.gdn import CHUNK_SIZE, _solve_unit_lower, l2norm, recurrent_steps, scan_packed
from tailreplay_sglang.ops.kda import kda_gate


def _chunk_scan(q, k, v, g, beta, state, chunk_size: int, state_only: bool = False, entering: list | None = None):
    """One sequence. q, k: [HV, T, K]; v: [HV, T, V]; g: [HV, T, K] log decays; beta: [HV, T]; state [HV, V, K].

    The WY form of `ops.gdn._chunk_scan` with per-channel decays: with G_i the cumulative log decay inside the chunk,
    (I + A) u = beta v - beta (k * exp(G)) S0^T, A_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc) for j < i. Every
    exponent is a decay over tokens inside the chunk (<= 0), so nothing overflows however fast a channel forgets.
    Returns (o [HV, T, V] or None when `state_only`, final state); `entering` gets the state entering each chunk.
    """
    HV, T, K = k.shape
    pad = (-T) % chunk_size
    if pad:  # zero-padded tokens: k = 0 and g = 0 leave the state untouched
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n, C = (T + pad) // chunk_size, chunk_size
    q, k, v, g = (x.view(HV, n, C, -1).transpose(0, 1) for x in (q, k, v, g))
    G = g.cumsum(2)  # [n, HV, C, K]
    beta = beta.view(HV, n, C).transpose(0, 1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()[None, :, :, None]
    o = None if state_only else torch.empty(n, HV, C, v.shape[-1], dtype=torch.float32, device=v.device)

    for c in range(n):
        if entering is not None:  # the initial state may be a view of the pool, rewritten when the scan ends
            entering.append(state.clone() if c == 0 else state)
        Gc, kc = G[c], k[c]
        decay = (Gc.unsqueeze(2) - Gc.unsqueeze(1)).masked_fill(~causal, float("-inf")).exp()  # [HV, C, C, K]
        k_from = kc.unsqueeze(1) * decay  # k_j exp(G_i - G_j), row i
        A = (beta[c].unsqueeze(-1) * (kc.unsqueeze(2) * k_from).sum(-1)).tril(-1)
        rhs = torch.cat([beta[c].unsqueeze(-1) * v[c], beta[c].unsqueeze(-1) * kc * Gc.exp()], dim=-1)
        solved = _solve_unit_lower(A, rhs)
        u = solved[..., : v.shape[-1]] - solved[..., v.shape[-1]:] @ state.transpose(-1, -2)  # [HV, C, V]
        if o is not None:
            attn = (q[c].unsqueeze(2) * k_from).sum(-1)  # q_i . k_j exp(G_i - G_j), j <= i
            o[c] = (q[c] * Gc.exp()) @ state.transpose(-1, -2) + attn @ u
        last = Gc[:, -1:, :]
        state = state * last.exp() + u.transpose(-1, -2) @ (kc * (last - Gc).exp())
    if o is None:
        return None, state
    return o.transpose(0, 1).reshape(HV, n * C, -1)[:, :T], state


def chunk_kda(
    q, k, v, g, beta, initial_state, cu_seqlens=None, initial_state_indices=None,
    use_qk_l2norm_in_kernel: bool = False, scale: float | None = None, A_log=None, dt_bias=None,
    lower_bound: float | None = None, beta_is_raw: bool = False, chunk_size: int = CHUNK_SIZE,
    state_only: bool = False, chunk_states: bool = False,
):
    """Chunked KDA prefill over a packed varlen batch.

    q, k, v: [1, T, HV, d]; g: [1, T, HV, K], the raw forget-gate projection when `A_log` is given (gated here by
    `kda_gate`), else log decays; beta: [1, T, HV], raw (sigmoid taken here) when `beta_is_raw`.
    initial_state: the pool `[slots, HV, V, K]` read and written at `initial_state_indices` (slot < 0: zero state,
    nothing written), or `[B, HV, V, K]` when the indices are None.
    Returns (o [1, T, HV, V] in v's dtype or None when `state_only`, final states [B, HV, V, K] float32), and with
    `chunk_states` also `h` [1, NT, HV, V, K]: the state entering each chunk of each sequence, as fla lays it out.
    """
    K = k.shape[-1]
    scale = K**-0.5 if scale is None else scale
    qf, kf = q[0].float(), k[0].float()
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * scale
    gf = kda_gate(g[0], A_log, dt_bias, lower_bound) if A_log is not None else g[0].float()
    bf = beta[0].float().sigmoid() if beta_is_raw else beta[0].float()
    return scan_packed(_chunk_scan, qf, kf, v, gf, bf, initial_state, cu_seqlens, initial_state_indices,
                       chunk_size, state_only, chunk_states)


def recurrent_kda_update(A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices,
                         cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False, lower_bound: float | None = None,
                         scale: float | None = None):
    """Decode: the gate and the token-by-token KDA step, states updated in place in the pool.

    q, k, v: [1, T, HV, d]; a: the raw forget gate, [T, HV * K] (or [1, T, HV, K]); b: raw beta, [T, HV] or
    [1, T, HV]; cu_seqlens [B + 1] (None: one token per slot). Returns o: [1, T, HV, V]."""
    qf, kf, g, beta = recurrent_inputs(A_log, dt_bias, q, k, v, a, b, use_qk_l2norm_in_kernel, lower_bound, scale)
    return recurrent_steps(qf, kf, v, g, beta, initial_state_source, initial_state_indices, cu_seqlens)


def recurrent_inputs(A_log, dt_bias, q, k, v, a, b, use_qk_l2norm_in_kernel: bool = False,
                     lower_bound: float | None = None, scale: float | None = None):
    """What a token-by-token KDA step reads (decode, and the speculative verify of `spec_verify`): float32 q (normed
    if asked, scaled) and k [T, HV, K], the per-channel log decays g [T, HV, K] and sigmoid beta [T, HV]."""
    T, HV, K = k.shape[1], v.shape[2], k.shape[-1]
    g = kda_gate(a.reshape(T, HV, K), A_log, dt_bias, lower_bound)
    beta = b.reshape(T, HV).float().sigmoid()
    qf, kf = q[0].float(), k[0].float()
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    return qf * (K**-0.5 if scale is None else scale), kf, g, beta
