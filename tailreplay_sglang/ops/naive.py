"""Token-by-token references for the CPU ops, written for clarity and run in float64 by the tests."""

import torch
import torch.nn.functional as F


def naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, scale=None, use_qk_l2norm=False):
    """One sequence, plain recurrence. q, k: [T, HV, K] (already expanded to value heads); v: [T, HV, V];
    g, beta: [T, HV]; initial_state: [HV, V, K]. Returns (o [T, HV, V], final state [HV, V, K]).

        S_t = a_t S_{t-1} + beta_t (v_t - a_t S_{t-1} k_t) k_t^T,   a_t = exp(g_t),   o_t = S_t q_t * scale

    KDA's recurrence with the same decay on every key channel."""
    return naive_recurrent_kda(q, k, v, g.unsqueeze(-1).expand(*g.shape, k.shape[-1]), beta, initial_state, scale,
                               use_qk_l2norm)


def naive_causal_conv1d(x, weight, bias=None, initial_state=None, silu=True):
    """One sequence. x: [dim, T]; weight: [dim, width]; initial_state: [dim, width - 1] left context.
    Returns (y [dim, T], final state [dim, width - 1])."""
    dim, width = weight.shape
    left = torch.zeros(dim, width - 1, dtype=x.dtype) if initial_state is None else initial_state
    window = torch.cat([left, x], dim=-1)
    y = torch.stack([(window[:, t : t + width] * weight).sum(-1) for t in range(x.shape[1])], dim=-1)
    if bias is not None:
        y = y + bias[:, None]
    return (F.silu(y) if silu else y), window[:, -(width - 1):]


def naive_ssd(x, dt, A, B, C, D=None, initial_state=None):
    """One sequence, plain Mamba2 recurrence. x: [T, H, P]; dt: [T, H] (after bias / softplus); A: [H];
    B, C: [T, H, N] (groups expanded to heads); D: [H]; initial_state: [H, P, N]. Returns (y [T, H, P], state).

        S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,   y_t = S_t C_t + D x_t
    """
    T, H, P = x.shape
    S = torch.zeros(H, P, B.shape[-1], dtype=x.dtype) if initial_state is None else initial_state.clone()
    y = torch.empty_like(x)
    for t in range(T):
        S = S * (dt[t] * A).exp()[:, None, None] + torch.einsum("hp,hn->hpn", dt[t][:, None] * x[t], B[t])
        y[t] = torch.einsum("hpn,hn->hp", S, C[t])
        if D is not None:
            y[t] = y[t] + D[:, None] * x[t]
    return y, S


def naive_recurrent_kda(q, k, v, g, beta, initial_state=None, scale=None, use_qk_l2norm=False):
    """One sequence, plain KDA recurrence: the GDN one with a per-channel decay. q, k: [T, HV, K]; v: [T, HV, V];
    g: [T, HV, K] log decays; beta: [T, HV]; initial_state: [HV, V, K]. Returns (o [T, HV, V], final state).

        S_t = S_{t-1} diag(exp(g_t)) + beta_t (v_t - S_{t-1} diag(exp(g_t)) k_t) k_t^T,   o_t = S_t q_t * scale
    """
    T, HV, K = k.shape
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    scale = K**-0.5 if scale is None else scale
    S = torch.zeros(HV, v.shape[-1], K, dtype=q.dtype) if initial_state is None else initial_state.clone()
    o = torch.empty(T, HV, v.shape[-1], dtype=q.dtype)
    for t in range(T):
        S = S * g[t].exp()[:, None, :]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))
        S = S + torch.einsum("hv,hk->hvk", delta, k[t])
        o[t] = torch.einsum("hvk,hk->hv", S, q[t]) * scale
    return o, S
