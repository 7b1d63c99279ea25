"""Gated DeltaNet under hyper-connections (Qwen3.8-Flash-Next, `Qwen4ExpForConditionalGeneration`).

The residual stream is `hc_count` streams, [T, hc x hidden]. Each layer reads its mixer's input and its MLP's input
through a gated residual (`attn_hyper_connection` / `mlp_hyper_connection`, SGLang's `GatedResidual`): `mix` is a
low-rank gated mean of the per-stream-normed streams; `combine` adds the block's output to every stream with that
stream's own weight, computed from the same normed streams. The streams part after the first `combine`, so a group's
input is all of them: the store keeps hc x hidden values per token and group (`HybridLayout.streams`). The layers
have no input norm (SGLang deletes them). A layer's replay is `mix` -> SGLang's GDN projections -> the plugin's GDN
kernel (`families.gdn.gdn_inputs`, `replay_gdn_layer`) -> `combine`, then `mix` -> MLP / MoE -> `combine`, through
the layer's own modules; the group's last layer computes only its states.

Capture: each stored group's first decoder layer's keyword `hidden_states`, the streams as they enter the layer. At
layer 0 that is the embedding [T, hidden], which the model widens into hc copies: the store keeps the copies (group
0 of a vision-language checkpoint), so every row has one width; group 0 of a text replay re-embeds and widens.

Per-layer embeddings (PLE: a hashed n-gram embedding and a dilated short conv on `ple_layer_ids`) keep two more
per-request states that the replay does not rebuild yet; a checkpoint with PLE layers is refused
(`layout._refuse_unsupported_mixers`).
"""

import torch

from tailreplay_sglang import capture
from tailreplay_sglang.families.base import ReplayBatch, replayed_layer_requirements
from tailreplay_sglang.families.gdn import GdnFamily, gdn_inputs
from tailreplay_sglang.kernels.replay import replay_gdn_layer
from tailreplay_sglang.ops.gdn import gdn_gating

_MIXER = ("linear_attn._forward_input_proj", "linear_attn.fix_query_key_value_ordering", "linear_attn.head_v_dim",
          "linear_attn.norm", "linear_attn.out_proj", "linear_attn.attn.conv_weights", "linear_attn.attn.bias",
          "linear_attn.A_log", "linear_attn.dt_bias", "attn_hyper_connection.mix", "attn_hyper_connection.combine")
_FEED_FORWARD = ("mlp", "mlp_hyper_connection.mix", "mlp_hyper_connection.combine")


class HyperGdnFamily(GdnFamily):
    name = "gdn_hc"
    dp_attention = False  # not tested on this family
    speculative = True  # Qwen3.8-Flash-Next's MTP head

    def install_capture(self, model, store) -> list:
        return capture.at_layer_keyword_inputs(model.layers, store)

    def group_input(self, model, group, x: torch.Tensor) -> torch.Tensor:
        hyper = model.layers[group.first_layer].attn_hyper_connection
        return capture.widened(x, hyper.hc_count, hyper.hidden_size)

    def replay_layer(self, layer, cache, x: torch.Tensor, batch: ReplayBatch, state_only: bool):
        return replay_layer(layer, cache, x, batch, state_only)

    def required(self, model, layout) -> list:
        return replayed_layer_requirements(model, layout, lambda layer_id: _MIXER, _FEED_FORWARD)


def replay_layer(layer, cache, x: torch.Tensor, batch: ReplayBatch, state_only: bool):
    """One GDN decoder layer over the packed tails' streams x [T, hc x hidden]; conv and recurrent states land in the
    requests' slots. Returns the streams leaving the layer, or None when only the states were needed."""
    la = layer.linear_attn
    h, residuals = layer.attn_hyper_connection.mix(x)
    mixed, a, b, output = gdn_inputs(la, h)
    g, _ = gdn_gating(la.A_log, a, b, la.dt_bias)
    batch.observe_decay(g[0])
    core = replay_gdn_layer(mixed, a, b, la.attn.conv_weights, la.attn.bias, la.A_log, la.dt_bias, batch.cu_seqlens,
                            batch.mamba_slots, cache.conv[0], cache.temporal, state_only=state_only,
                            max_seqlen=max(batch.tail_lens), cu_seqlens_cpu=batch.cu_seqlens_cpu)
    if state_only:
        return None
    x = layer.attn_hyper_connection.combine(output(core), residuals)
    h, residuals = layer.mlp_hyper_connection.mix(x)
    return layer.mlp_hyper_connection.combine(batch.feed_forward(layer.mlp, h), residuals)


FAMILY = HyperGdnFamily()
