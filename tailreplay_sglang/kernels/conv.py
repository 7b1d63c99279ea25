"""Causal depthwise conv1d of a replay (zero left context), writing each tail's conv state into its mamba slot.

A replay starts from a zero state, so each tail is convolved as if preceded by zeros, and its conv state (the last
`width - 1` conv inputs, zeros where the tail is shorter) goes straight into the pool. Programs tile (dim block,
tail, token block), so long tails spread over the whole device; the first token block of each tail also writes
the tail's conv state.
"""

import torch
import triton
import triton.language as tl

from tailreplay_sglang.cpu.naive import naive_causal_conv1d

BLOCK_T, BLOCK_D = 32, 128


@triton.heuristics({"HAS_BIAS": lambda args: args["bias"] is not None})
@triton.jit
def replay_causal_conv1d_kernel(
    x, weight, bias, y, conv_states, cu_seqlens, slots,
    stride_x, stride_w, stride_y, stride_s, stride_s_d, stride_s_w,
    D, W: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    i_d, i_n, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_tok = bos + i_c * BT + tl.arange(0, BT)
    m_t = o_tok < eos  # grid covers the longest tail; blocks past a shorter tail's end are fully masked

    b_y = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_BIAS:
        b_y += tl.load(bias + o_d, mask=m_d, other=0.).to(tl.float32)[None, :]
    for i_w in tl.static_range(W):
        o_src = o_tok - (W - 1) + i_w
        m_src = (m_t & (o_src >= bos))[:, None] & m_d[None, :]
        b_x = tl.load(x + o_src[:, None] * stride_x + o_d[None, :], mask=m_src, other=0.).to(tl.float32)
        b_w = tl.load(weight + o_d * stride_w + i_w, mask=m_d, other=0.).to(tl.float32)
        b_y += b_x * b_w[None, :]
    b_y = b_y / (1. + tl.exp(-b_y))  # SiLU
    tl.store(y + o_tok[:, None] * stride_y + o_d[None, :], b_y.to(y.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])

    if i_c == 0:  # conv state: the last W - 1 inputs, zeros before the tail's start
        i_slot = tl.load(slots + i_n).to(tl.int64)
        o_w = tl.arange(0, BW)
        o_last = eos - (W - 1) + o_w
        m_w = (o_w < W - 1)[:, None] & m_d[None, :]
        b_last = tl.load(x + o_last[:, None] * stride_x + o_d[None, :], mask=m_w & (o_last >= bos)[:, None], other=0.)
        p_s = conv_states + i_slot * stride_s + o_d[None, :] * stride_s_d + o_w[:, None] * stride_s_w
        tl.store(p_s, b_last.to(conv_states.dtype.element_ty), mask=m_w)


def replay_causal_conv1d(x, weight, bias, cu_seqlens, slots, conv_states, max_seqlen: int | None = None):
    """Causal depthwise conv1d + SiLU over a packed batch of tails, each from zero left context.

    x: [T, dim] pre-conv inputs (SGLang's `mixed_qkv`; token stride free, dim contiguous); weight: [dim, width];
    bias: [dim] or None; cu_seqlens: [N + 1]; slots: [N] mamba slot of each tail;
    conv_states: [num_slots, dim, width - 1] pool (any strides): slot slots[i] gets tail i's last width - 1 inputs.
    max_seqlen: longest tail (read from cu_seqlens when None, which syncs with the device).
    Returns y: [T, dim] in x's dtype.
    """
    T, D = x.shape
    W = weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and conv_states.shape[1:] == (D, W - 1)
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    y = torch.empty_like(x)
    grid = (triton.cdiv(D, BLOCK_D), len(slots), triton.cdiv(max_seqlen, BLOCK_T))
    replay_causal_conv1d_kernel[grid](
        x=x, weight=weight, bias=bias, y=y, conv_states=conv_states, cu_seqlens=cu_seqlens, slots=slots,
        stride_x=x.stride(0), stride_w=weight.stride(0), stride_y=y.stride(0), stride_s=conv_states.stride(0),
        stride_s_d=conv_states.stride(1), stride_s_w=conv_states.stride(2),
        D=D, W=W, BW=triton.next_power_of_2(W - 1), BT=BLOCK_T, BD=BLOCK_D,
    )
    return y


def naive_replay_causal_conv1d(x, weight, bias, cu_seqlens):
    """Reference, tail by tail from zero left context. Shapes as `replay_causal_conv1d`.

    Returns (y [T, dim], conv states [N, dim, width - 1]).
    """
    ys, states = [], []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        y, state = naive_causal_conv1d(x[start:end].T, weight, bias)
        ys.append(y.T)
        states.append(state)
    return torch.cat(ys), torch.stack(states)
