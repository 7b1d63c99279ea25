"""Kimi Delta Attention (Kimi Linear, Ling-3.0).

A layer is input norm -> KDA mixer (q | k | v, beta, forget gate and output gate projections; conv; chunked KDA;
gated norm; output projection) -> post-attention norm -> dense MLP or MoE, each added back to the residual stream,
as `KimiDecoderLayer` runs it; the group's last KDA layer computes only its states. Ling-3.0's
`BailingMoELinearDecoderLayer` is the same stages with the mixer at `.attention` (SGLang builds it as Kimi's
`KimiDeltaAttention`) where Kimi's is at `.self_attn` (`mixer_name`). The kernels are the ones
SGLang's KDA backend calls (the Triton causal conv and `chunk_kda` on a GPU, whatever binds them on a CPU), reached
at their defining modules rather than through `kda_backend`, whose names carry the interval-anchor hooks of the
forward being prepared (the replay also pauses those, `lifecycle.replay_after_clear`).

The group input is captured at the layer's `attn_boundary`. Interval anchors: conv states from the prefill conv's
input, as GDN's; SSM states from the chunked prefill's per-chunk states, which it is asked for when anchors are
planned.
"""

import functools
import inspect

import torch

from tailreplay_sglang import capture
from tailreplay_sglang.families.base import (Family, ReplayBatch, layer_requirements, reduction_owner,
                                             replayed_layer_requirements, tp_reduced)
from tailreplay_sglang.families.gdn import write_anchor_conv_states  # noqa: F401 (KDA's prefill conv row)
from tailreplay_sglang.ops.kda import kda_gate

_CONV = "sglang.kernels.ops.mamba.causal_conv1d_triton:causal_conv1d_fn"
_CHUNK = "sglang.srt.layers.attention.linear.kernels.kda_triton:chunk_kda"
_MIXER = ("do_fuse_qkvbfg", "o_norm", "o_proj", "head_dim", "attn.conv_weights", "attn.bias", "attn.q_dim",
          "attn.k_dim", "attn.v_dim", "attn.head_q_dim", "attn.head_k_dim", "attn.head_v_dim", "attn.A_log",
          "attn.dt_bias", "attn.lower_bound")


class KdaFamily(Family):
    name = "kda"
    anchor_prefill_backends = ("triton",)  # write_anchor_ssm_states wraps TritonKDAKernel.extend
    # SGLang's breakable prefill graph runs the GDN extend eagerly between its segments, but KDA's inside them
    # (GPU path review N4)
    anchor_capturing_prefill_graphs = ("full", "breakable")
    eager_prefill_flag = "--disable-prefill-cuda-graph"
    speculative = True  # Ling-3.0's MTP head (tests/test_speculative.py)

    def install_capture(self, model, store) -> list:
        return capture.at_stage_boundaries(model.layers, store, lambda layer: layer.attn_boundary)

    def replay_group(self, model, pool, group, x: torch.Tensor, batch: ReplayBatch) -> None:
        for layer_id in group.recurrent_layers:
            layer = model.layers[layer_id]
            mixer = getattr(layer, mixer_name(layer))
            out = replay_mixer(mixer, pool, layer_id, layer.input_layernorm(x), batch)
            if layer_id == group.recurrent_layers[-1]:
                return
            x = x + tp_reduced(out, mixer.o_proj)
            x = x + tp_reduced(layer.mlp(layer.post_attention_layernorm(x)), reduction_owner(layer.mlp))

    def required(self, model, layout) -> list:
        boundaries = layer_requirements(model, [g.first_layer for g in layout.groups], ("attn_boundary.prepare",))

        def paths(layer_id):
            name = mixer_name(model.layers[layer_id])
            fused = getattr(getattr(model.layers[layer_id], name, None), "do_fuse_qkvbfg", False)
            projection = f"{name}.forward_qkvbfg_fused" if fused else f"{name}.forward_qkvbfg"
            return ("input_layernorm", projection) + tuple(f"{name}.{p}" for p in _MIXER)
        return boundaries + replayed_layer_requirements(model, layout, paths)

    def required_kernels(self) -> tuple[str, ...]:
        return (_CONV, _CHUNK)


def mixer_name(layer) -> str:
    """Where a decoder layer keeps its KDA mixer: `self_attn` (Kimi Linear) or `attention` (Ling-3.0)."""
    return "attention" if hasattr(layer, "attention") and not hasattr(layer, "self_attn") else "self_attn"


def _conv_kernel():
    from sglang.kernels.ops.mamba import causal_conv1d_triton

    return causal_conv1d_triton.causal_conv1d_fn


def _chunk_kernel():
    from sglang.srt.layers.attention.linear.kernels import kda_triton

    return kda_triton.chunk_kda


def kda_inputs(la, h: torch.Tensor):
    """The mixer's pre-conv q | k | v [T, 3 * H * K], raw beta [T, H], raw forget gate [T, H * K] and output gate
    [T, H * K], through the same (fused or separate) projections as its forward."""
    project = la.forward_qkvbfg_fused if la.do_fuse_qkvbfg else la.forward_qkvbfg
    # GLM-5.3-Flash's projections take the forward batch too, which they do not read
    return project(h, None) if _takes_forward_batch(project.__func__) else project(h)


@functools.cache
def _takes_forward_batch(function) -> bool:
    return "forward_batch" in inspect.signature(function).parameters


def replay_mixer(mixer, pool, layer_id: int, h: torch.Tensor, batch: ReplayBatch) -> torch.Tensor:
    """Layer `layer_id`'s KDA mixer over the batch's tails from its normed input h: states into the batch's slots,
    log decays into its survival bound. Returns the output before its TP sum (a group's last layer needs none)."""
    out, log_decay = replay_kda_mixer(mixer, pool.mamba2_layer_cache(layer_id), h, batch.cu_seqlens,
                                      batch.tail_lens, batch.mamba_slots)
    batch.observe_decay(log_decay)
    return out


def replay_kda_mixer(la, cache, h: torch.Tensor, cu_seqlens: torch.Tensor, tail_lens: list[int],
                     mamba_slots: torch.Tensor):
    """One KDA mixer over the tails (h: the normed input, [T, hidden]), every tail from its slot's state. Returns
    (the mixer's output before its TP reduction [T, hidden], the log decays [T, H * K])."""
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


def write_anchor_ssm_states(runtime, original, kernel, *args, **kwargs):
    """AROUND SGLang's KDA prefill kernel (`TritonKDAKernel.extend`, every device): the planned anchors' SSM states,
    from its per-chunk states, which it is asked for whenever an anchor is planned (extra_buffer asks for them
    too; the caller gets the shape it asked for)."""
    anchors = runtime.interval_anchors
    if not anchors.by_slot:
        return original(kernel, *args, **kwargs)
    wanted = kwargs.get("return_intermediate_states", False)
    out = original(kernel, *args, **dict(kwargs, return_intermediate_states=True))
    anchors.write_ssm_states(out[1], kwargs["ssm_states"], kwargs["cache_indices"], kwargs["query_start_loc"])
    return out if wanted else out[0]


FAMILY = KdaFamily()
