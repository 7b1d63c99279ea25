"""Gated DeltaNet in pure torch: gating, a chunked prefill and a one-token-per-step recurrent update.

Layout follows SGLang's GDN backend: tokens are packed (`[1, T, heads, dim]`) with `cu_seqlens`, value heads may be
grouped over key heads (HV = G * H, value head `i` reads key head `i // G`), and recurrent states live in a pool of
shape `[slots, HV, V, K]` (value-major, as SGLang's mamba pool stores them) addressed by per-sequence slot indices.
All math runs in float32; states are written back in the pool's dtype.
"""

import torch
import torch.nn.functional as F

from tailreplay_sglang.config import GDN_CHUNK as CHUNK_SIZE


def gdn_gating(A_log, a, b, dt_bias, softplus_beta: float = 1.0, softplus_threshold: float = 20.0,
               beta_scale: float = 1.0):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = beta_scale * sigmoid(b); both float32 of shape `[1, T, HV]`.

    beta_scale 2 is OLMo-Hybrid's `linear_allow_neg_eigval`: beta in (0, 2), so I - beta k k^T may have a negative
    eigenvalue (still non-expansive for unit k)."""
    x = a.float() + dt_bias.float()
    g = -A_log.float().exp() * F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)
    beta = b.float().sigmoid() * beta_scale
    return g.unsqueeze(0), beta.unsqueeze(0)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _expand_key_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[T, H, K] -> [T, HV, K]: value head i reads key head i // (HV // H)."""
    return x.repeat_interleave(num_v_heads // x.shape[1], dim=1)


def _seq_bounds(cu_seqlens, total: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, total)]
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def _chunk_scan(q, k, v, g, beta, state, chunk_size: int, state_only: bool = False, entering: list | None = None):
    """One sequence. q, k: [HV, T, K]; v: [HV, T, V]; g, beta: [HV, T]; state: [HV, V, K] (float32).

    WY form of the delta rule inside each chunk (as in fla's chunk kernels): with gamma_i the cumulative decay
    inside the chunk, the per-token state corrections u solve (I + A) u = beta*v - beta*gamma*K S0^T, where
    A_ij = beta_i (gamma_i / gamma_j) k_i.k_j for j < i. Chunks run in sequence, everything inside one is batched.
    Returns (o [HV, T, V], final state [HV, V, K]); o is None when `state_only` (the output half is skipped).
    `entering`, when given, receives the state entering each chunk (what fla's chunk kernel returns as `h`).
    """
    HV, T, K = k.shape
    pad = (-T) % chunk_size
    if pad:  # zero-padded tokens: k = 0 and g = 0 leave the state untouched
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n, C = (T + pad) // chunk_size, chunk_size
    # chunk-major layout [n, HV, C, d], so each step of the sequential loop reads contiguous blocks
    q, k, v = (x.view(HV, n, C, -1).transpose(0, 1).contiguous() for x in (q, k, v))
    g = g.view(HV, n, C).transpose(0, 1).cumsum(-1)
    beta = beta.view(HV, n, C).transpose(0, 1)

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # gamma_i / gamma_j
    A = (beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([beta.unsqueeze(-1) * v, (beta * g.exp()).unsqueeze(-1) * k], dim=-1)
    solved = _solve_unit_lower(A, rhs)
    U, W = solved[..., : v.shape[-1]].contiguous(), solved[..., v.shape[-1] :].contiguous()
    k_to_end = k * (g[..., -1:] - g).exp().unsqueeze(-1)  # k_i * gamma_C / gamma_i
    chunk_decay = g[..., -1].exp()[..., None, None]  # gamma_C per chunk and head
    if not state_only:
        attn = (q @ k.transpose(-1, -2)) * decay
        q_decayed = q * g.exp().unsqueeze(-1)
        o = torch.empty_like(v)

    for c in range(n):
        if entering is not None:  # the initial state may be a view of the pool, rewritten when the scan ends
            entering.append(state.clone() if c == 0 else state)
        u = U[c] - W[c] @ state.transpose(-1, -2)  # [HV, C, V]
        if not state_only:
            o[c] = q_decayed[c] @ state.transpose(-1, -2) + attn[c] @ u
        state = state * chunk_decay[c] + u.transpose(-1, -2) @ k_to_end[c]
    if state_only:
        return None, state
    return o.transpose(0, 1).reshape(HV, n * C, -1)[:, :T], state


def _solve_unit_lower(A: torch.Tensor, rhs: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Solve (I + A) x = rhs for strictly lower-triangular A, batched: blocked forward substitution.

    Used instead of torch.linalg.solve_triangular, whose batched CPU path took seconds on 2 busy cores when another
    process competed for them (as a server and its client do); this is a few dozen batched matmuls either way.
    """
    x = rhs.clone()
    C = A.shape[-1]
    for start in range(0, C, block):
        end = min(start + block, C)
        if start:
            x[..., start:end, :] -= A[..., start:end, :start] @ x[..., :start, :]
        for i in range(start + 1, end):
            x[..., i, :] -= (A[..., i:i + 1, start:i] @ x[..., start:i, :]).squeeze(-2)
    return x


def chunk_gated_delta_rule(
    q, k, v, g, beta, initial_state, cu_seqlens=None, initial_state_indices=None,
    use_qk_l2norm_in_kernel: bool = False, scale: float | None = None, chunk_size: int = CHUNK_SIZE,
    state_only: bool = False, chunk_states: bool = False,
):
    """Chunked GDN prefill over a packed varlen batch.

    q, k: [1, T, H, K]; v: [1, T, HV, V]; g (log decay), beta: [1, T, HV]; cu_seqlens: [B + 1] or None.
    initial_state: [slots, HV, V, K] pool read at `initial_state_indices` ([B]) and updated in place there
    (slot < 0 means padding: start from zero, write nothing), or [B, HV, V, K] when indices are None.
    Returns (o [1, T, HV, V] in v's dtype, final states [B, HV, V, K] float32); o is None when `state_only`
    (the last GDN layer of a replayed group needs only its state).
    chunk_states: also return `h` [1, NT, HV, V, K] float32, the state entering each `chunk_size`-token chunk of each
    sequence (NT = sum of ceil(len / chunk_size), sequences in order), as fla's chunk kernel returns it: SGLang's
    extra_buffer tracking and Tail-Replay's interval anchors read it (`h[chunks of the sequences before i + j]` = the
    state of sequence i after j chunks).
    """
    HV, K = v.shape[2], k.shape[-1]
    scale = K**-0.5 if scale is None else scale
    qf, kf = q[0].float(), k[0].float()
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    qf, kf = _expand_key_heads(qf, HV) * scale, _expand_key_heads(kf, HV)
    gf, bf = g[0].float(), beta[0].float()
    return scan_packed(_chunk_scan, qf, kf, v, gf, bf, initial_state, cu_seqlens, initial_state_indices, chunk_size,
                       state_only, chunk_states)


def scan_packed(chunk_scan, qf, kf, v, gf, bf, initial_state, cu_seqlens, initial_state_indices, chunk_size: int,
                state_only: bool, chunk_states: bool):
    """Run a one-sequence `chunk_scan` (GDN's or KDA's) over each sequence of a packed batch: float32 q, k, gates,
    betas `[T, HV, ...]` and v `[1, T, HV, V]`, states read from and written to the pool; returns what
    `chunk_gated_delta_rule` does."""
    HV, V, K = v.shape[2], v.shape[-1], kf.shape[-1]
    vf = v[0].float()
    o = None if state_only else torch.empty(v.shape[1:], dtype=torch.float32, device=v.device)
    finals, entering = [], [] if chunk_states else None
    for i, (start, end) in enumerate(_seq_bounds(cu_seqlens, v.shape[1])):
        state = _read_state(initial_state, initial_state_indices, i, HV, V, K)
        seq = [x[start:end].transpose(0, 1) for x in (qf, kf, vf, gf, bf)]
        o_seq, state = chunk_scan(*seq, state, chunk_size, state_only, entering)
        if o is not None:
            o[start:end] = o_seq.transpose(0, 1)
        _write_state(initial_state, initial_state_indices, i, state)
        finals.append(state)
    o = None if o is None else o.unsqueeze(0).to(v.dtype)
    if chunk_states:
        h = torch.stack(entering) if entering else v.new_empty(0, HV, V, K, dtype=torch.float32)
        return o, torch.stack(finals), h.unsqueeze(0)
    return o, torch.stack(finals)


def _read_state(pool, indices, i: int, HV: int, V: int, K: int) -> torch.Tensor:
    if pool is None:
        return torch.zeros(HV, V, K, dtype=torch.float32)
    slot = i if indices is None else int(indices[i])
    if slot < 0:
        return torch.zeros(HV, V, K, dtype=torch.float32, device=pool.device)
    return pool[slot].float()


def _write_state(pool, indices, i: int, state: torch.Tensor) -> None:
    if pool is None:
        return
    slot = i if indices is None else int(indices[i])
    if slot >= 0:
        pool[slot] = state.to(pool.dtype)


def recurrent_gated_delta_rule_update(
    A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices, cu_seqlens=None,
    use_qk_l2norm_in_kernel: bool = False, softplus_beta: float = 1.0, softplus_threshold: float = 20.0,
    scale: float | None = None, beta_scale: float = 1.0,
):
    """Decode: gating fused with the token-by-token delta rule, states updated in place in the pool.

    q, k: [1, T, H, K]; v: [1, T, HV, V]; a, b: [T, HV]; cu_seqlens [B + 1] (None: one token per slot).
    Every sequence advances one token per step, so a decode batch is a single batched step.
    Returns o: [1, T, HV, V].
    """
    qf, kf, g, beta = recurrent_inputs(A_log, dt_bias, q, k, v, a, b, use_qk_l2norm_in_kernel, softplus_beta,
                                       softplus_threshold, scale, beta_scale)
    return recurrent_steps(qf, kf, v, g.unsqueeze(-1), beta, initial_state_source, initial_state_indices, cu_seqlens)


def recurrent_inputs(A_log, dt_bias, q, k, v, a, b, use_qk_l2norm: bool, softplus_beta: float = 1.0,
                     softplus_threshold: float = 20.0, scale: float | None = None, beta_scale: float = 1.0):
    """The token-by-token delta rule's inputs in float32: q (l2-normed if asked, scaled) and k expanded to the value
    heads [T, HV, K], log decays g [T, HV] and beta [T, HV] (also what speculative decoding's verify steps take)."""
    HV, K = v.shape[2], k.shape[-1]
    scale = K**-0.5 if scale is None else scale
    g, beta = gdn_gating(A_log, a, b, dt_bias, softplus_beta, softplus_threshold, beta_scale)
    qf, kf = q[0].float(), k[0].float()
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    return _expand_key_heads(qf, HV) * scale, _expand_key_heads(kf, HV), g[0], beta[0]


def recurrent_steps(qf, kf, v, g, beta, pool, indices, cu_seqlens):
    """The delta rule token by token on every sequence at once, states read from and written back to the pool:
    float32 q, k [T, HV, K] (q scaled), v [1, T, HV, V], log decays g [T, HV, 1] (GDN) or [T, HV, K] (KDA, per key
    channel), beta [T, HV]. Returns o: [1, T, HV, V] in v's dtype."""
    HV, K = v.shape[2], kf.shape[-1]
    vf = v[0].float()
    bounds = _seq_bounds(cu_seqlens, v.shape[1]) if cu_seqlens is not None else [(t, t + 1) for t in range(v.shape[1])]
    slots = indices.long()
    live = slots >= 0
    state = torch.zeros(len(bounds), HV, v.shape[-1], K, dtype=torch.float32, device=v.device)
    state[live] = pool[slots[live]].float()
    starts = torch.tensor([s for s, _ in bounds], device=v.device)
    lens = torch.tensor([e - s for s, e in bounds], device=v.device)
    o = torch.zeros(v.shape[1:], dtype=torch.float32, device=v.device)
    for step in range(int(lens.max()) if len(bounds) else 0):
        active = lens > step
        t = (starts + step)[active]
        s = state[active] * g[t].exp().unsqueeze(-2)
        delta = beta[t].unsqueeze(-1) * (vf[t] - (s @ kf[t].unsqueeze(-1)).squeeze(-1))
        s = s + delta.unsqueeze(-1) * kf[t].unsqueeze(-2)
        o[t] = (s @ qf[t].unsqueeze(-1)).squeeze(-1)
        state[active] = s
    pool[slots[live]] = state[live].to(pool.dtype)
    return o.unsqueeze(0).to(v.dtype)
