"""Causal depthwise conv1d of a replay, each tail continuing from the conv state in its mamba slot.

A tail's left context is the conv state its slot holds (the last `width - 1` conv inputs before the tail, oldest
first): zeros after SGLang cleared the slot (zero-init replay), or an anchor's state copied into it (anchored replay,
then exact). The tail's own conv state (the last `width - 1` inputs of context + tail) then replaces it. Programs tile
(dim block, tail, token block), so long tails spread over the whole device; the first token block of each tail also
writes the tail's conv state.

NOTE: the contexts are read from a snapshot of the tails' slots taken before the launch, not from the pool. The
program that writes a slot's new state (token block 0) is not the only reader of its old one: within a program the
warps are not ordered, so one warp could store the new state while another still reads the old context. The
snapshot (N x dim x (width - 1) elements, one gather) makes the order irrelevant, with no barrier to reason about.
"""

import torch
import triton
import triton.language as tl

from tailreplay_sglang.ops.naive import naive_causal_conv1d

BLOCK_T, BLOCK_D = 32, 128


@triton.jit
def _load_window(x, init, o_pos, bos, i_n, o_d, mask, stride_x, stride_i, stride_i_d, stride_i_w, W: tl.constexpr):
    """Conv inputs at token positions o_pos [B] x dims o_d [BD], as float32: x from the tail's start `bos` on, the
    initial context (init[i_n], its last entry the input just before `bos`) for positions before it."""
    m_tail = mask & (o_pos >= bos)[:, None]
    m_init = mask & (o_pos < bos)[:, None]
    b_x = tl.load(x + o_pos[:, None] * stride_x + o_d[None, :], mask=m_tail, other=0.).to(tl.float32)
    p_init = init + i_n * stride_i + o_d[None, :] * stride_i_d + (o_pos - bos + W - 1)[:, None] * stride_i_w
    return b_x + tl.load(p_init, mask=m_init, other=0.).to(tl.float32)


@triton.heuristics({"HAS_BIAS": lambda args: args["bias"] is not None})
@triton.jit
def replay_causal_conv1d_kernel(
    x, weight, bias, y, init, conv_states, cu_seqlens, slots,
    stride_x, stride_w, stride_y, stride_i, stride_i_d, stride_i_w, stride_s, stride_s_d, stride_s_w,
    D, W: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    i_d, i_n, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_tok = bos + i_c * BT + tl.arange(0, BT)
    m_t = o_tok < eos  # grid covers the longest tail; blocks past a shorter tail's end are fully masked
    m_td = m_t[:, None] & m_d[None, :]

    b_y = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_BIAS:
        b_y += tl.load(bias + o_d, mask=m_d, other=0.).to(tl.float32)[None, :]
    for i_w in tl.static_range(W):
        o_src = o_tok - (W - 1) + i_w
        b_x = _load_window(x, init, o_src, bos, i_n, o_d, m_td, stride_x, stride_i, stride_i_d, stride_i_w, W)
        b_w = tl.load(weight + o_d * stride_w + i_w, mask=m_d, other=0.).to(tl.float32)
        b_y += b_x * b_w[None, :]
    b_y = b_y / (1. + tl.exp(-b_y))  # SiLU
    tl.store(y + o_tok[:, None] * stride_y + o_d[None, :], b_y.to(y.dtype.element_ty), mask=m_td)

    if i_c == 0:  # conv state: the last W - 1 inputs, from the initial context where the tail is shorter
        i_slot = tl.load(slots + i_n).to(tl.int64)
        o_w = tl.arange(0, BW)
        m_w = (o_w < W - 1)[:, None] & m_d[None, :]
        b_last = _load_window(x, init, eos - (W - 1) + o_w, bos, i_n, o_d, m_w,
                              stride_x, stride_i, stride_i_d, stride_i_w, W)
        p_s = conv_states + i_slot * stride_s + o_d[None, :] * stride_s_d + o_w[:, None] * stride_s_w
        tl.store(p_s, b_last.to(conv_states.dtype.element_ty), mask=m_w)


def replay_causal_conv1d(x, weight, bias, cu_seqlens, slots, conv_states, max_seqlen: int | None = None):
    """Causal depthwise conv1d + SiLU over a packed batch of tails, each continuing from its slot's conv state.

    x: [T, dim] pre-conv inputs (SGLang's `mixed_qkv`; token stride free, dim contiguous); weight: [dim, width];
    bias: [dim] or None; cu_seqlens: [N + 1]; slots: [N] distinct mamba slot of each tail;
    conv_states: [num_slots, dim, width - 1] pool (any strides): slot slots[i] holds tail i's left context (zeros
    after SGLang cleared it, or a copied anchor state) and gets the last width - 1 inputs of context + tail i.
    max_seqlen: longest tail (read from cu_seqlens when None, which syncs with the device).
    Returns y: [T, dim] in x's dtype.
    """
    T, D = x.shape
    W = weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and conv_states.shape[1:] == (D, W - 1)
    assert W - 1 <= BLOCK_T  # token block 0 holds every token that reads the initial context
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    init = conv_states.index_select(0, slots)  # the snapshot the kernel reads, see the module's NOTE
    y = torch.empty_like(x)
    grid = (triton.cdiv(D, BLOCK_D), len(slots), triton.cdiv(max_seqlen, BLOCK_T))
    replay_causal_conv1d_kernel[grid](
        x=x, weight=weight, bias=bias, y=y, init=init, conv_states=conv_states, cu_seqlens=cu_seqlens, slots=slots,
        stride_x=x.stride(0), stride_w=weight.stride(0), stride_y=y.stride(0),
        stride_i=init.stride(0), stride_i_d=init.stride(1), stride_i_w=init.stride(2),
        stride_s=conv_states.stride(0), stride_s_d=conv_states.stride(1), stride_s_w=conv_states.stride(2),
        D=D, W=W, BW=triton.next_power_of_2(W - 1), BT=BLOCK_T, BD=BLOCK_D,
    )
    return y


def naive_replay_causal_conv1d(x, weight, bias, cu_seqlens, initial_states=None):
    """Reference, tail by tail. Shapes as `replay_causal_conv1d`; initial_states: [N, dim, width - 1] left context
    of each tail (None: zeros).

    Returns (y [T, dim], conv states [N, dim, width - 1]).
    """
    ys, states = [], []
    bounds = cu_seqlens.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        left = None if initial_states is None else initial_states[i]
        y, state = naive_causal_conv1d(x[start:end].T, weight, bias, initial_state=left)
        ys.append(y.T)
        states.append(state)
    return torch.cat(ys), torch.stack(states)
