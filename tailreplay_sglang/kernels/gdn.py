"""Gated DeltaNet replay from the state in each tail's mamba slot: one Triton kernel per (tail, value head, V-block),
plus its reference.

The replay pass needs, per GDN layer and per tail, the recurrent state after the tail (written into the request's
mamba slot) and, except for the last GDN layer of a group, the per-token outputs. Each tail starts from the state its
slot holds: zeros after SGLang cleared it (zero-init replay), or an anchor's state copied into it (anchored replay,
then exact). Gating (`g`, `beta` from the raw
`a`, `b`) and the q/k l2-norm are fused into the kernel, so the replay reads the conv output once.

Design: each program walks its tail chunk by chunk (BT tokens) with its `[BV, K]` block of the state in registers.
Inside a chunk it uses the WY form of the delta rule, as fla's chunk kernels do: with gamma_i the cumulative decay in
the chunk and A_ij = beta_i (gamma_i / gamma_j) k_i.k_j (j < i), the per-token corrections are
u = (I + A)^-1 beta (v - gamma S k); (I + A)^-1 comes from a BT-step forward substitution (BT = 16 keeps that short),
the rest are small `tl.dot`s. Unlike fla, which splits the work over several kernels with a grid over chunks, one
pass does everything: it loads the initial state from the slot (in float32), walks the chunks and writes the final
state back over it. The state-only variant (`state_only=True`) skips the output half of each chunk (q S^T, the
masked q k^T and its product with u) and the output store. The interpreter (TRITON_INTERPRET=1) runs it.

In-place is safe: each program alone reads and writes its `[BV, K]` block of the slot, and every stored element
depends on the loaded one (S = gamma S + ...), so no thread can store before the load it depends on has completed.
"""

import torch
import triton
import triton.language as tl

from tailreplay_sglang.ops.naive import naive_recurrent_gated_delta_rule

CHUNK_SIZE = 16
BLOCK_V = 32


@triton.jit
def _gates(p_a, p_b, mask, b_neg_A, b_dt_bias, beta_scale):
    """g = -exp(A_log) * softplus(a + dt_bias) (softplus threshold 20, as SGLang), beta = beta_scale * sigmoid(b)
    (beta_scale 2: OLMo-Hybrid's negative eigenvalues); 0 if masked.

    NOTE: builtins only: tl.sigmoid is itself a jit function, and each jit call costs the interpreter about 0.5 ms.
    """
    b_x = tl.load(p_a, mask=mask, other=0.).to(tl.float32) + b_dt_bias
    b_softplus = tl.where(b_x <= 20., tl.log(1. + tl.exp(tl.minimum(b_x, 20.))), b_x)
    b_g = tl.where(mask, b_neg_A * b_softplus, 0.)
    b_beta = tl.where(mask, beta_scale / (1. + tl.exp(-tl.load(p_b, mask=mask, other=0.).to(tl.float32))), 0.)
    return b_g, b_beta


@triton.jit
def _load_l2norm(p, mask):
    """Rows of a [BT, BK] block, each divided by sqrt(||row||^2 + 1e-6) (fla's l2norm, as SGLang calls it)."""
    b_x = tl.load(p, mask=mask, other=0.).to(tl.float32)
    return b_x * tl.rsqrt(tl.sum(b_x * b_x, 1) + 1e-6)[:, None]


@triton.jit
def _unit_lower_inverse(b_A, BT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(I + A)^-1 for a strictly lower-triangular [BT, BT] block, row by row: X_i = e_i - sum_{j<i} A_ij X_j.

    Step i multiplies X by A with all rows but i masked out; rows j < i of X are final by then.
    """
    o_t = tl.arange(0, BT)
    b_X = tl.where(o_t[:, None] == o_t[None, :], 1., 0.)
    for i in range(1, BT):
        b_X -= tl.dot(tl.where(o_t[:, None] == i, b_A, 0.), b_X, input_precision=DOT_PRECISION)
    return b_X


@triton.heuristics({"STORE_OUTPUT": lambda args: args["o"] is not None})
@triton.jit
def gdn_replay_fwd_kernel(
    q, k, v, a, b, A_log, dt_bias, o, ht, cu_seqlens, slots,
    stride_q, stride_k, stride_v, stride_a, stride_b, stride_ht,
    scale, beta_scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STORE_OUTPUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_lower = o_t[:, None] > o_t[None, :]
    m_causal = o_t[:, None] >= o_t[None, :]
    b_neg_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    b_dt_bias = tl.load(dt_bias + i_hv).to(tl.float32)

    i_slot = tl.load(slots + i_n).to(tl.int64)
    p_ht = ht + i_slot * stride_ht + i_hv * (V * K) + o_v[:, None] * K + o_k[None, :]
    m_ht = m_v[:, None] & m_k[None, :]
    b_h = tl.load(p_ht, mask=m_ht, other=0.).to(tl.float32)  # S[v, k] of this program's value block, from the slot
    for i_c in range(tl.cdiv(eos - bos, BT)):
        o_tok = bos + i_c * BT + o_t
        m_t = o_tok < eos
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = _load_l2norm(q + o_tok[:, None] * stride_q + i_h * K + o_k[None, :], m_tk) * scale
        b_k = _load_l2norm(k + o_tok[:, None] * stride_k + i_h * K + o_k[None, :], m_tk)
        p_v = v + o_tok[:, None] * stride_v + i_hv * V + o_v[None, :]
        b_v = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32)
        b_g, b_beta = _gates(a + o_tok * stride_a + i_hv, b + o_tok * stride_b + i_hv, m_t, b_neg_A, b_dt_bias,
                             beta_scale)
        # padded tokens have g = beta = 0 and k = 0: they leave the state and the cumulative decay alone
        b_gc = tl.cumsum(b_g, 0)
        b_gl = tl.sum(tl.where(o_t == BT - 1, b_gc, 0.))
        b_decay = tl.exp(tl.where(m_causal, b_gc[:, None] - b_gc[None, :], float("-inf")))

        # WY form: u = (I + A)^-1 beta (v - gamma S k), A_ij = beta_i (gamma_i / gamma_j) k_i.k_j for j < i
        b_kk = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION)
        b_A = tl.where(m_lower, b_beta[:, None] * b_kk * b_decay, 0.)
        b_Sk = tl.dot(b_k, tl.trans(b_h), input_precision=DOT_PRECISION)
        b_u = b_beta[:, None] * (b_v - tl.exp(b_gc)[:, None] * b_Sk)
        b_u = tl.dot(_unit_lower_inverse(b_A, BT, DOT_PRECISION), b_u, input_precision=DOT_PRECISION)

        if STORE_OUTPUT:  # o_i = gamma_i S q_i + sum_{j<=i} (gamma_i / gamma_j) (q_i.k_j) u_j
            b_qk = tl.where(m_causal, tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * b_decay, 0.)
            b_o = tl.exp(b_gc)[:, None] * tl.dot(b_q, tl.trans(b_h), input_precision=DOT_PRECISION)
            b_o += tl.dot(b_qk, b_u, input_precision=DOT_PRECISION)
            p_o = o + o_tok[:, None] * (HV * V) + i_hv * V + o_v[None, :]
            tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

        # state at the chunk's end: S = gamma_C S + sum_i (gamma_C / gamma_i) u_i k_i^T
        b_u = b_u * tl.exp(b_gl - b_gc)[:, None]
        b_h = b_h * tl.exp(b_gl) + tl.dot(tl.trans(b_u), b_k, input_precision=DOT_PRECISION)

    tl.store(p_ht, b_h.to(ht.dtype.element_ty), mask=m_ht)


def gdn_replay_fwd(
    q, k, v, a, b, A_log, dt_bias, cu_seqlens, slots, ssm_states,
    scale: float | None = None, state_only: bool = False, chunk_size: int = CHUNK_SIZE, beta_scale: float = 1.0,
):
    """GDN over a packed batch of tails, each from the state in its mamba slot; final states replace them.

    q, k: [T, H, K]; v: [T, HV, V] (HV a multiple of H; value head i reads key head i // (HV // H)). Any token
    stride works (views of the conv output), heads and dims must be contiguous. q and k are l2-normalised in the
    kernel and q is scaled by `scale` (default K**-0.5).
    a, b: [T, HV] raw gate inputs (token stride free); A_log, dt_bias: [HV]: g = -exp(A_log) softplus(a + dt_bias),
    beta = beta_scale * sigmoid(b).
    cu_seqlens: [N + 1] tail boundaries; slots: [N] distinct mamba slot of each tail.
    ssm_states: [num_slots, HV, V, K] pool (value-major, SGLang's layout): tail i starts from slot slots[i] (zeros
    after SGLang cleared it, or a copied anchor state; read in float32) and the slot gets its final state, cast to the
    pool's dtype; no other slot is read or written.
    Returns o: [T, HV, V] in v's dtype, or None when `state_only` (the last GDN layer of a group).
    """
    T, H, K = k.shape
    HV, V = v.shape[1:]
    assert q.shape == k.shape and HV % H == 0 and a.shape == b.shape == (T, HV)
    assert all(x.stride(-1) == 1 for x in (q, k, v, a, b)) and q.stride(1) == k.stride(1) == K and v.stride(1) == V
    assert ssm_states.shape[1:] == (HV, V, K) and ssm_states[0].is_contiguous()
    o = None if state_only else v.new_empty(T, HV, V)
    BV = min(BLOCK_V, max(16, triton.next_power_of_2(V)))
    grid = (triton.cdiv(V, BV), len(slots) * HV)
    gdn_replay_fwd_kernel[grid](
        q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, o=o, ht=ssm_states,
        cu_seqlens=cu_seqlens, slots=slots,
        stride_q=q.stride(0), stride_k=k.stride(0), stride_v=v.stride(0), stride_a=a.stride(0),
        stride_b=b.stride(0), stride_ht=ssm_states.stride(0),
        scale=K**-0.5 if scale is None else scale, beta_scale=float(beta_scale),
        H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=max(16, triton.next_power_of_2(K)), BV=BV,
        # fp32 inputs ask for fp32 dots (TF32 would cost the float32 tolerance); bf16 runs on tensor cores
        DOT_PRECISION="ieee" if v.dtype == torch.float32 else "tf32",
    )
    return o


def naive_gdn_gating(A_log, a, b, dt_bias, beta_scale: float = 1.0):
    """Reference gating, in the inputs' dtype. a, b: [T, HV]; A_log, dt_bias: [HV]. Returns g, beta: [T, HV]."""
    x = a + dt_bias
    softplus = torch.where(x <= 20, torch.log1p(torch.exp(x.clamp(max=20))), x)
    return -A_log.exp() * softplus, beta_scale * torch.sigmoid(b)


def naive_gdn_replay(q, k, v, a, b, A_log, dt_bias, cu_seqlens, scale=None, initial_states=None,
                     beta_scale: float = 1.0):
    """Token-by-token reference of `gdn_replay_fwd` in the inputs' dtype (tests use float64).

    Shapes as in `gdn_replay_fwd`; initial_states: [N, HV, V, K] state each tail starts from (None: zeros).
    Returns (o [T, HV, V], final states [N, HV, V, K]).
    """
    HV = v.shape[1]
    g, beta = naive_gdn_gating(A_log, a, b, dt_bias, beta_scale)
    q, k = (x.repeat_interleave(HV // x.shape[1], dim=1) for x in (q, k))
    o, states = torch.empty_like(v), []
    bounds = cu_seqlens.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        o[start:end], state = naive_recurrent_gated_delta_rule(
            q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end],
            initial_state=None if initial_states is None else initial_states[i], scale=scale, use_qk_l2norm=True,
        )
        states.append(state)
    return o, torch.stack(states)
