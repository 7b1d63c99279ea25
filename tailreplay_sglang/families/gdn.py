"""Gated DeltaNet (Qwen3.5 dense, MoE and vision-language; Qwen3-Next; OLMo-Hybrid).

Every decoder layer of a group is a GDN mixer and its MLP or MoE. A layer's replay runs input norm -> projections ->
conv -> GDN (`kernels.replay.replay_gdn_layer`: Triton on GPU, the torch ops on CPU), its states written into the
requests' slots; the group's last GDN layer computes only its states (its outputs, norm, output projection and
feed-forward feed nothing the next group uses). OLMo-Hybrid's GDN layers are pre-norm like Qwen3.5's (its post-norm
attention layers are never replayed), so the same recipe serves it with its own projections and beta = 2 sigmoid(b)
(`gdn_inputs`, `beta_scale`).

The group input is captured before `linear_attn` (or the whole decoder layer where it carries the residual stream).
Interval anchors come from SGLang's prefill conv (conv states: the inputs before each offset) and its chunked GDN
prefill, which returns the state entering every 64-token chunk (`h`); the hooks below are the INTERVAL_ANCHORS rows'
bodies.
"""

import torch

from tailreplay_sglang import capture
from tailreplay_sglang.families.base import Family, ReplayBatch, replayed_layer_requirements, tp_reduced
from tailreplay_sglang.kernels.replay import replay_gdn_layer
from tailreplay_sglang.ops.gdn import gdn_gating

_QWEN_INPUTS = ("linear_attn._forward_input_proj", "linear_attn.fix_query_key_value_ordering",
                "linear_attn.head_v_dim", "linear_attn.norm", "linear_attn.out_proj")
_OWN_INPUTS = ("linear_attn.project", "linear_attn.output")  # models whose GDN module projects itself (OLMo-Hybrid)
_CORE = ("input_layernorm", "linear_attn.attn.conv_weights", "linear_attn.attn.bias", "linear_attn.A_log",
         "linear_attn.dt_bias")


class GdnFamily(Family):
    name = "gdn"
    anchor_prefill_backends = ("triton",)  # write_anchor_ssm_states wraps the Triton chunk kernel
    dp_attention = True
    speculative = True  # Qwen3.5's and Qwen3-Next's MTP heads (tests/test_speculative.py)

    def install_capture(self, model, store) -> list:
        return capture.at_mixer_inputs(model.layers, store, "linear_attn")

    def replay_group(self, model, pool, group, x: torch.Tensor, batch: ReplayBatch) -> None:
        x = self.group_input(model, group, x)
        for i, layer_id in enumerate(group.recurrent_layers):
            last = i == len(group.recurrent_layers) - 1
            x = self.replay_layer(model.layers[layer_id], pool.mamba2_layer_cache(layer_id), x, batch, state_only=last)

    def group_input(self, model, group, x: torch.Tensor) -> torch.Tensor:
        """The residual-stream value the group's first layer reads, from what the store or the embeddings give."""
        return x

    def replay_layer(self, layer, cache, x: torch.Tensor, batch: ReplayBatch, state_only: bool):
        return replay_layer(layer, cache, x, batch, state_only)

    def feed_forwards(self, model, layout) -> list:
        """Each group's layers but its last feed the next layer through their MLP or MoE (`replay_layer`)."""
        return [model.layers[i].mlp for group in layout.groups for i in group.recurrent_layers[:-1]]

    def required(self, model, layout) -> list:
        def paths(layer_id):
            own = hasattr(getattr(model.layers[layer_id], "linear_attn", None), "project")
            return _CORE + (_OWN_INPUTS if own else _QWEN_INPUTS)
        return replayed_layer_requirements(model, layout, paths)


def replay_layer(layer, cache, x: torch.Tensor, batch: ReplayBatch, state_only: bool):
    """One GDN decoder layer over the packed tails; conv and recurrent states land in the requests' slots.
    Returns the next residual-stream value, or None when only the states were needed."""
    la = layer.linear_attn
    h = layer.input_layernorm(x)
    mixed, a, b, output = gdn_inputs(la, h)
    g, _ = gdn_gating(la.A_log, a, b, la.dt_bias)  # T x HV: cheap beside the layer
    batch.observe_decay(g[0])
    core = replay_gdn_layer(mixed, a, b, la.attn.conv_weights, la.attn.bias, la.A_log, la.dt_bias, batch.cu_seqlens,
                            batch.mamba_slots, cache.conv[0], cache.temporal, state_only=state_only,
                            max_seqlen=max(batch.tail_lens), beta_scale=getattr(la, "beta_scale", 1.0),
                            cu_seqlens_cpu=batch.cu_seqlens_cpu)
    if state_only:
        return None
    x = x + output(core)
    return x + batch.feed_forward(layer.mlp, layer.post_attention_layernorm(x))


def gdn_inputs(la, h: torch.Tensor):
    """The GDN module's pre-conv q | k | v [T, conv_dim], raw gates a, b [T, HV] and a function from the core
    output to the module's output, each through the model's own layers."""
    T = h.shape[0]
    if hasattr(la, "project"):  # separate projections and a g-projection gate (OLMo-Hybrid)
        mixed, a, b = la.project(h)
        return mixed, a, b, lambda core: la.output(core, h)
    qkvz, ba = la._forward_input_proj(h)
    q, k, v, z, b, a = la.fix_query_key_value_ordering(qkvz, ba)  # Qwen's interleaved layout of its projections
    mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)

    def output(core):
        dv = la.head_v_dim
        return tp_reduced(la.out_proj(la.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(T, -1))[0], la.out_proj)

    return mixed, a.reshape(T, -1), b.reshape(T, -1), output


def write_anchor_conv_states(runtime, original, x, *args, **kwargs):
    """AROUND SGLang's prefill conv (its backends pass the state arguments by keyword): the planned anchors' conv
    states, from its input, before it updates the slots."""
    runtime.interval_anchors.write_conv_states(x, kwargs["conv_states"], kwargs["cache_indices"],
                                               kwargs["query_start_loc"], kwargs["has_initial_state"])
    return original(x, *args, **kwargs)


def write_anchor_ssm_states(runtime, original, *args, **kwargs):
    """AROUND SGLang's chunked GDN prefill (`gdn_triton.TritonGDNKernel.extend` passes everything by keyword): the
    planned anchors' SSM states, from the per-chunk states it returns."""
    out = original(*args, **kwargs)
    runtime.interval_anchors.write_ssm_states(out[2], kwargs["initial_state"], kwargs["initial_state_indices"],
                                              kwargs["cu_seqlens"])
    return out


FAMILY = GdnFamily()
