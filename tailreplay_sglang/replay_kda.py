"""Kimi Linear's KDA layers over the packed replay tails, through the model's own projections, conv weights, output
norm and SGLang's kernel entry points, with conv and recurrent states read from and written to the requests' slots.

A layer is input norm -> KDA mixer (q | k | v, beta, forget gate and output gate projections; conv; chunked KDA;
gated norm; output projection) -> post-attention norm -> dense MLP or MoE, each added back to the residual stream,
as `KimiDecoderLayer` runs it. The kernels are the ones SGLang's KDA backend calls: the Triton causal conv and
`chunk_kda` on a GPU, the torch bodies of `cpu/kda.py` on a CPU. They are reached at their defining modules, not
through `kda_backend`, whose names carry the interval-anchor hooks of the forward being prepared (the replay also
pauses those, `lifecycle.replay_after_clear`). Every tail starts from its slot's state, so all rows have one.
"""

import torch

from tailreplay_sglang.ops.kda import kda_gate


def _conv_kernel():
    from sglang.kernels.ops.mamba import causal_conv1d_triton

    return causal_conv1d_triton.causal_conv1d_fn


def _chunk_kernel():
    from sglang.srt.layers.attention.linear.kernels import kda_triton

    return kda_triton.chunk_kda


def kda_inputs(la, h: torch.Tensor):
    """The mixer's pre-conv q | k | v [T, 3 * H * K], raw beta [T, H], raw forget gate [T, H * K] and output gate
    [T, H * K], through the same (fused or separate) projections as its forward."""
    if la.do_fuse_qkvbfg:
        return la.forward_qkvbfg_fused(h)
    return la.forward_qkvbfg(h)


def replay_kda_mixer(la, cache, h: torch.Tensor, cu_seqlens: torch.Tensor, tail_lens: list[int],
                     mamba_slots: torch.Tensor):
    """One KDA mixer over the tails (h: the normed input, [T, hidden]). Returns (the mixer's output before its TP
    reduction [T, hidden], the log decays [T, H * K])."""
    attn = la.attn
    mixed, beta, forget, gate = kda_inputs(la, h)
    slots = mamba_slots.to(torch.int32)
    qkv = _conv_kernel()(
        mixed.transpose(0, 1), attn.conv_weights, attn.bias, activation="silu",
        conv_states=cache.conv[0].transpose(-1, -2), query_start_loc=cu_seqlens.to(torch.int32),
        seq_lens_cpu=tail_lens, cache_indices=slots,
        has_initial_state=torch.ones(len(tail_lens), dtype=torch.bool, device=h.device),
    ).transpose(0, 1)
    q, k, v = qkv.split([attn.q_dim, attn.k_dim, attn.v_dim], dim=-1)
    T = h.shape[0]
    q, k, v = (x.reshape(1, T, -1, d) for x, d in ((q, attn.head_q_dim), (k, attn.head_k_dim), (v, attn.head_v_dim)))
    forget = forget.reshape(1, T, -1, attn.head_k_dim)
    core = _chunk_kernel()(
        q=q, k=k, v=v, g=forget, beta=beta.unsqueeze(0), initial_state=cache.temporal, initial_state_indices=slots,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.to(torch.int32), A_log=attn.A_log,
        dt_bias=attn.dt_bias, lower_bound=attn.lower_bound, beta_is_raw=True,
    )
    out = la.o_norm(core, gate.unflatten(-1, (-1, la.head_dim))).squeeze(0).flatten(-2)
    log_decay = kda_gate(forget[0], attn.A_log, attn.dt_bias, attn.lower_bound).reshape(T, -1)
    return la.o_proj(out)[0], log_decay
