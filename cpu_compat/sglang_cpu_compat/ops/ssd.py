"""Mamba2's state-space duality (SSD) scan in pure torch: a chunked varlen prefill and a one-token decode update.

Layout follows SGLang's Mamba2 mixer (`layers/attention/mamba/mamba.py`): tokens are packed (`[1, T, heads, P]`)
with `cu_seqlens`, B and C have `G` groups shared by `H // G` heads each, and SSM states live in a pool of shape
`[slots, H, P, N]` addressed by per-sequence slot indices. Per head h, with a_t = exp(dt_t A_h):

    S_t = a_t S_{t-1} + dt_t x_t B_t^T,    y_t = S_t C_t + D_h x_t        (S: [P, N])

The prefill computes each sequence in chunks of `chunk_size` tokens counted from the sequence's start: inside a chunk
by the quadratic (attention-like) form, across chunks by carrying the state. All math runs in float32. `dt` is
processed by the plugin's `process_dt`, which its Mamba2 replay shares.
"""

import torch
import torch.nn.functional as F

from tailreplay_sglang.ops.ssd import process_dt


def _expand_groups(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[T, G, N] -> [T, H, N]: head h reads group h // (H // G)."""
    return x.repeat_interleave(num_heads // x.shape[1], dim=1)


def ssd_sequence(x, dt, A, B, C, initial_state, chunk_size: int, state_at=()):
    """One sequence. x: [T, H, P]; dt: [T, H] (processed); A: [H]; B, C: [T, H, N]; initial_state: [H, P, N].
    Returns (y [T, H, P] without the D term, final state, {position: state after that many tokens} for each
    position in `state_at`)."""
    T = x.shape[0]
    S = initial_state.float()
    y = torch.empty(T, *x.shape[1:], dtype=torch.float32)
    wanted = {}
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        for pos in state_at:
            if start < pos < end:  # mid-chunk: the state after pos - start of this chunk's tokens
                wanted[pos] = _advance(S, x[start:pos], dt[start:pos], A, B[start:pos])
        y[start:end], S = _chunk(S, x[start:end].float(), dt[start:end], A, B[start:end].float(),
                                 C[start:end].float())
        for pos in state_at:
            if pos == end:
                wanted[pos] = S
    for pos in state_at:
        if pos == 0:
            wanted[pos] = initial_state.float()
    return y, S, wanted


def _chunk(S, x, dt, A, B, C):
    """One chunk of L tokens from state S: (y [L, H, P], state after the chunk)."""
    a = dt * A.float()  # [L, H] log-decays
    cs = a.cumsum(0)  # [L, H]
    diff = cs[:, None, :] - cs[None, :, :]  # [l, s, H]: log decay from after s to l
    causal = torch.ones(diff.shape[:2], dtype=torch.bool).tril()[:, :, None]
    decay = torch.where(causal, diff, float("-inf")).exp()  # s > l masked before exp: no inf * 0
    scores = torch.einsum("lhn,shn->lsh", C, B) * decay * dt[None, :, :]
    y = torch.einsum("lsh,shp->lhp", scores, x) + torch.einsum("lhn,hpn->lhp", C, S) * cs.exp()[:, :, None]
    to_end = (cs[-1:] - cs).exp() * dt  # [L, H]: weight of token s in the chunk-end state
    S = S * cs[-1].exp()[:, None, None] + torch.einsum("sh,shp,shn->hpn", to_end, x, B)
    return y, S


def _advance(S, x, dt, A, B):
    """The state after running x (no outputs)."""
    if x.shape[0] == 0:
        return S
    cs = (dt * A.float()).cumsum(0)
    to_end = (cs[-1:] - cs).exp() * dt
    return S * cs[-1].exp()[:, None, None] + torch.einsum("sh,shp,shn->hpn", to_end, x.float(), B.float())


def chunk_scan(x, dt, A, B, C, chunk_size: int, D=None, initial_states=None, cu_seqlens=None, state_at=None):
    """Packed varlen prefill. x: [T, H, P]; dt: [T, H] (processed); B, C: [T, G, N]; initial_states: [n, H, P, N]
    or None (zeros). Returns (y [T, H, P] float32 with the D term, final states [n, H, P, N], the states at
    `state_at`, a list of (sequence, position within it): a [len, H, P, N] tensor, or None)."""
    T, H, P = x.shape
    N = B.shape[-1]
    Bh, Ch = _expand_groups(B, H), _expand_groups(C, H)
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    y = torch.empty(T, H, P, dtype=torch.float32)
    finals = []
    requested = {}
    for (seq, pos) in state_at or ():
        requested.setdefault(seq, []).append(pos)
    found = {}
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = x.new_zeros(H, P, N, dtype=torch.float32) if initial_states is None else initial_states[i]
        y[s:e], final, wanted = ssd_sequence(x[s:e], dt[s:e], A, Bh[s:e], Ch[s:e], init, chunk_size,
                                             requested.get(i, ()))
        finals.append(final)
        found.update({(i, pos): st for pos, st in wanted.items()})
    if D is not None:
        y = y + x.float() * (D.float() if D.dim() == 2 else D.float()[:, None])
    track = torch.stack([found[k] for k in state_at]) if state_at else None
    return y, torch.stack(finals), track


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, out=None):
    """One decode token per sequence, in place on the pool. state: [slots, H, P, N]; x: [b, H, P]; dt: [b, H]
    (or [b, H, P], as SGLang expands it: all P equal); A: [H] or [H, P, N]; B, C: [b, G, N]; D: [H] or [H, P].
    Slot index -1 is a padded row: nothing read or written, output zero."""
    b, H, P = x.shape
    if dt.dim() == 3:
        dt = dt[..., 0]
        dt_bias = None if dt_bias is None else (dt_bias[:, 0] if dt_bias.dim() == 2 else dt_bias)
    A = A[:, 0, 0] if A.dim() == 3 else A
    dt = process_dt(dt, dt_bias, dt_softplus)
    slots = (torch.arange(b) if state_batch_indices is None else state_batch_indices).long()
    live = slots >= 0
    S = torch.zeros(b, H, P, state.shape[-1], dtype=torch.float32)
    S[live] = state[slots[live]].float()
    Bh, Ch = _expand_groups(B.float(), H), _expand_groups(C.float(), H)
    S = S * (dt * A.float()).exp()[:, :, None, None] + (dt[:, :, None] * x.float())[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", S, Ch)
    if D is not None:
        y = y + x.float() * (D.float() if D.dim() == 2 else D.float()[:, None])
    if z is not None:
        y = y * F.silu(z.float())
    state[slots[live]] = S[live].to(state.dtype)
    y[~live] = 0
    if out is not None:
        out.copy_(y.view_as(out).to(out.dtype))
        return out
    return y.to(x.dtype)
