"""Lightning attention (Ling-2.5's linear mixer) in torch: linear attention with a fixed decay per head.

Per head with decay rate s (> 0, the layer's slope), the state S [D_k, D_v] and output follow
`S_t = exp(-s) S_{t-1} + k_t^T v_t` and `o_t = scale * q_t S_t` (the current token included), as SGLang's `seg_la`
kernels compute them. The decay does not depend on the data, so the state after any position is a closed form of
the state at an earlier one and the tokens between:
`S_b = exp(-s (b - a)) S_a + sum_{a <= j < b} exp(-s (b - 1 - j)) k_j^T v_j`.
Within a chunk every exponent is a decay over tokens of that chunk (<= 0), so nothing overflows however slowly a head
forgets.
"""

import torch

CHUNK_SIZE = 64


def scan(q, k, v, slope, state, scale: float, ends=(), state_only: bool = False):
    """One sequence: q, k, v [T, H, D] (q unused, may be None, when `state_only`); slope [H]; state [H, D_k, D_v],
    the state entering the sequence (read, not written). Math in float32. Returns (o [T, H, D_v] or None when
    `state_only`, the final state, the states after each position in `ends` (offsets 0..T, ascending))."""
    q = None if state_only else q.float()
    k, v = k.float(), v.float()
    state, slope = state.float(), slope.float().reshape(-1)
    outs, states, start = [], [], 0
    for end in list(ends) + [k.shape[0]]:
        for c in range(start, end, CHUNK_SIZE):
            chunk = slice(c, min(c + CHUNK_SIZE, end))
            o, state = _chunk(None if q is None else q[chunk], k[chunk], v[chunk], slope, state, scale)
            outs.append(o)
        states.append(state)
        start = end
    o = None if state_only else (torch.cat(outs) if outs else q.new_zeros(0, *v.shape[1:]))
    return o, state, states[:-1]


def _chunk(q, k, v, slope, state, scale: float):
    """C tokens from `state`: (o [C, H, D_v] or None, the state after them)."""
    C = k.shape[0]
    i = torch.arange(C, device=k.device, dtype=torch.float32)
    decay_to_end = torch.exp(-slope[:, None] * (C - 1 - i))  # [H, C]: token j's weight in the chunk's end state
    new_state = (torch.exp(-slope * C)[:, None, None] * state
                 + torch.einsum("hj,jhk,jhv->hkv", decay_to_end, k, v))
    if q is None:
        return None, new_state
    gap = (i[:, None] - i[None, :]).clamp(min=0)  # [C, C]
    weights = torch.exp(-slope[:, None, None] * gap) * (i[:, None] >= i[None, :])  # [H, C, C]
    intra = torch.einsum("ihd,jhd,hij,jhv->ihv", q, k, weights, v)
    inter = torch.einsum("ihd,hi,hdv->ihv", q, torch.exp(-slope[:, None] * (i + 1)), state)
    return (intra + inter) * scale, new_state


def naive_recurrence(q, k, v, slope, state, scale: float):
    """The token-by-token recurrence in float64: the reference the chunked form is tested against. Returns (o, every
    state after each token [T, H, D_k, D_v])."""
    q, k, v, state = (x.double() for x in (q, k, v, state))
    decay = torch.exp(-slope.double().reshape(-1))[:, None, None]
    outs, states = [], []
    for t in range(k.shape[0]):
        state = decay * state + k[t][:, :, None] * v[t][:, None, :]
        outs.append(torch.einsum("hd,hdv->hv", q[t], state) * scale)
        states.append(state)
    return torch.stack(outs), torch.stack(states)
