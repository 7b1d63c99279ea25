"""Lightning attention's kernel for SGLang's CPU engine (Ling-2.5, `BailingMoeV2_5ForCausalLM`): SGLang's
`seg_la_fwd` (`kernels/ops/attention/linear/seg_la.py`, the lightning backend's prefill and decode) is Triton only.
A `replace` row of `hooks.CPU_ENGINE` puts this torch body, with the kernel's arguments, at its defining module
(SGLang's hook registry rebinds the backend's imported name too); the math is the plugin's `ops.lightning`, tested
against a float64 recurrence.
"""

import torch

from tailreplay_sglang.ops import lightning

TRACK_BLOCK = 32  # seg_la's prefill block: a tracked state is stored where a block ends at the tracked length


def seg_la_fwd(q, k, v, s, decay_scales, meta, caches=None, cache_indices=None, track_lens=None,
               track_state_indices=None, softmax_scale=None):
    """SGLang's `seg_la_fwd`: o [T, H, D]; each sequence's state read from and written to its slot of `s`
    ([slots, H, D_k, D_v]). As the Triton kernels: one token per sequence (T <= batch) is the decode kernel, which
    always reads the slot; otherwise a sequence starts from its slot where `s_scales` is non-zero and from zero
    where it is 0; slot -1 is skipped; `track_lens` stores the state after that many tokens into
    `track_state_indices` (extra_buffer's tracking)."""
    if caches is not None or meta.mask is not None:
        raise NotImplementedError("CPU seg_la: speculative decoding's verify (MTP caches, tree masks) is not ported")
    length, _, head_dim = q.shape
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    bs = meta.batch_size
    slope = decay_scales.reshape(-1)
    o = torch.zeros_like(q)
    decode = -(-length // bs) == 1
    offsets = list(range(bs + 1)) if decode else meta.q_offsets.tolist()
    slots, scales = meta.s_offsets.tolist(), meta.s_scales.tolist()
    tracks = _tracks(track_lens, track_state_indices, bs)
    for b in range(bs):
        start, end, slot = offsets[b], offsets[b + 1], slots[b]
        if slot < 0 or end <= start:
            continue
        entering = s[slot] if decode or scales[b] else torch.zeros_like(s[slot])
        track_len, track_slot = tracks[b]
        ends = (track_len,) if 0 < track_len <= end - start and track_slot >= 0 and (
            track_len % TRACK_BLOCK == 0 or track_len == end - start) else ()
        out, final, states = lightning.scan(q[start:end], k[start:end], v[start:end], slope, entering, scale, ends)
        o[start:end] = out.to(o.dtype)
        s[slot] = final.to(s.dtype)
        if states:
            s[track_slot] = states[0].to(s.dtype)
    return o


def _tracks(track_lens, track_state_indices, bs: int) -> list[tuple[int, int]]:
    if track_lens is None or track_state_indices is None:
        return [(0, -1)] * bs
    return list(zip(track_lens.tolist(), track_state_indices.tolist()))
