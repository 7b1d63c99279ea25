"""Kimi Delta Attention under manifold-constrained hyper-connections (GLM-5.3-Flash,
`Glm5NextForConditionalGeneration`).

The residual stream is `hc_mult` streams, [T, hc x hidden] (SGLang's `MHCState`, `layer_boundary/residual/mhc.py`).
A layer reads its mixer's input with `hc_attn_pre`: a sigmoid-weighted sum of the streams (weights computed from
the RMS-scaled streams), then the input norm; it writes the mixer's output back with `hc_post`: every stream gets
the output times its own post weight plus a Sinkhorn-normalised mix of all the streams (h_res). The feed-forward
block reads and writes the same way (`hc_ffn_pre`, `hc_post`). The streams part at layer 0's first write, so a
group's input is all of them: the store keeps hc x hidden values per token and group (`HybridLayout.streams`).

Capture: the residual stream SGLang's `attn_boundary` keeps after the group's first layer's read, which is the
streams as they enter the layer (layer 0: the embedding expanded into hc copies, `hc_expand`). A layer's replay is
the layer's own `hc_attn_pre` -> input norm -> the KDA mixer (`families.kda.replay_kda_mixer`, the kernels SGLang's
KDA backend runs) -> `hc_post`, then `hc_ffn_pre` -> post-attention norm -> MLP / MoE -> `hc_post`; the group's last
layer computes only its states. Interval anchors are KDA's (`families/kda.py`).
"""

import torch

from tailreplay_sglang import capture
from tailreplay_sglang.families.base import ReplayBatch, layer_requirements, replayed_layer_requirements, tp_reduced
from tailreplay_sglang.families.kda import _MIXER, KdaFamily, replay_mixer

_READS = ("hc_attn_pre", "hc_post", "input_layernorm", "self_attn.forward_qkvbfg")
_FEED_FORWARD = ("mlp", "hc_ffn_pre", "post_attention_layernorm")


class MhcKdaFamily(KdaFamily):
    name = "kda_mhc"
    dp_attention = False  # not tested on this family
    speculative = True  # GLM-5.3-Flash's MTP layer (tests/test_glm5.py)

    def install_capture(self, model, store) -> list:
        return capture.at_stage_boundaries(model.layers, store, lambda layer: layer.attn_boundary)

    def group_input(self, model, group, x: torch.Tensor) -> torch.Tensor:
        """All streams: stored ones as they are, re-embedded ids (group 0 of a text replay) expanded into copies."""
        return capture.widened(x, model.config.hc_mult, model.config.hidden_size)

    def replay_group(self, model, pool, group, x: torch.Tensor, batch: ReplayBatch) -> None:
        x = self.group_input(model, group, x)
        for layer_id in group.recurrent_layers:
            layer = model.layers[layer_id]
            h, h_res, h_post = read(layer.hc_attn_pre, layer.input_layernorm, x)
            mixer = layer.self_attn
            out = replay_mixer(mixer, pool, layer_id, h, batch)
            if layer_id == group.recurrent_layers[-1]:
                return
            x = layer.hc_post(tp_reduced(out, mixer.o_proj), x, h_res, h_post)
            h, h_res, h_post = read(layer.hc_ffn_pre, layer.post_attention_layernorm, x)
            x = layer.hc_post(batch.feed_forward(layer.mlp, h), x, h_res, h_post)

    def required(self, model, layout) -> list:
        def paths(layer_id):
            return _READS + tuple(f"self_attn.{p}" for p in _MIXER)
        boundaries = [(model, "config.hc_mult", "model")]
        boundaries += layer_requirements(model, [g.first_layer for g in layout.groups], ("attn_boundary.prepare",))
        return boundaries + replayed_layer_requirements(model, layout, paths, _FEED_FORWARD)


def read(pre, norm, streams: torch.Tensor):
    """A stage's input from the streams [T, hc x hidden], as `MHCState` reads it: the layer's hc pre (the weighted
    sum of the streams, and the h_res / h_post its write-back takes), then the stage's norm unless the pre fused it."""
    h, h_res, h_post, norm_fused = pre(streams, norm.weight.data, norm.variance_epsilon)
    return (h if norm_fused else norm(h)), h_res, h_post


FAMILY = MhcKdaFamily()
