"""Kimi Delta Attention under attention residuals (Kimi K3, `KimiK3LinearForCausalLM`).

K3's residual stream is not one running sum (`layers/attn_residual.py`, `layer_boundary/residual/attn_bank.py`).
Each layer's attention input and feed-forward input is a read of a bank: a softmax mixture, per token over depth, of
the bank's frozen rows and the running residual (`prefix`), scored by the read's own norm and one-output projection,
then normed by the layer's norm. Layer l with l % B == 0 (B = `attn_res_block_size`) banks the prefix its attention
read formed and restarts the running residual. So a layer depends on the token's rows banked below it as well as on
its running residual, all of them per token: a replay of a group's tail needs, for those tokens, the prefix formed
at the group's first attention read and the rows banked before it.

- Stored input: the prefix at the group's first attention read (`prefix_read`: the running residual SGLang's
  boundary keeps after the read, or, where the first layer banks, the row it banked).
- Bank rows: produced by the replay. Groups replay in layer order over the same tail tokens, and every banking layer
  is a KDA layer (`layout._refuse_unsupported_attn_residuals`), so each row below a group was banked by an earlier
  group's replay in this pass (group 0 re-embeds its tokens: its first layer banks the embedding).
- A layer's replay reads the bank through SGLang's own `AttnResidual` (the kernels the forward uses), runs the KDA
  mixer (`families.kda.replay_kda_mixer`) and, but for a group's last layer, the feed-forward read and the MLP / MoE.

Interval anchors are KDA's: the prefill's conv inputs and per-chunk states (`families/kda.py`).
"""

import torch

from tailreplay_sglang import capture
from tailreplay_sglang.families.base import ReplayBatch, layer_requirements, replayed_layer_requirements, tp_reduced
from tailreplay_sglang.families.kda import _MIXER, KdaFamily, replay_mixer

_READS = ("input_layernorm", "self_attention_res_norm", "self_attention_res_proj", "is_block_write_layer")
_FEED_FORWARD = ("mlp", "post_attention_layernorm", "mlp_res_norm", "mlp_res_proj")


class AttnResKdaFamily(KdaFamily):
    name = "kda_attn_res"
    dp_attention = False  # neither is tested on this family
    speculative = False

    def install_capture(self, model, store) -> list:
        return capture.at_stage_boundaries(model.layers, store, lambda layer: layer.attn_boundary,
                                           rows_of=lambda forward_batch: prefix_read(model, forward_batch))

    def replay_group(self, model, pool, group, x: torch.Tensor, batch: ReplayBatch) -> None:
        from sglang.srt.layers.attn_residual import AttnResidual

        banked = batch.pass_state.setdefault(self.name, [])  # rows banked by this pass's earlier groups, in order
        block = model.config.attn_res_block_size
        if len(banked) != -(-group.first_layer // block):
            raise RuntimeError(f"Tail-Replay ({self.name}): group {group.index} needs the rows banked below layer "
                               f"{group.first_layer}, and this pass holds {len(banked)}")
        bank = AttnResidual(x, len(banked) + len(group.recurrent_layers),
                            block_residual=torch.stack(banked, dim=1) if banked else None)
        pending, running = x, None
        for layer_id in group.recurrent_layers:
            layer = model.layers[layer_id]
            writes = layer.is_block_write_layer
            h, prefix = bank.forward(pending, running, layer.self_attention_res_proj, layer.self_attention_res_norm,
                                     layer.input_layernorm, write=writes)
            if writes:
                banked.append(prefix)
            running = None if writes else prefix
            mixer = layer.self_attn
            out = replay_mixer(mixer, pool, layer_id, h, batch)
            if layer_id == group.recurrent_layers[-1]:
                return
            h, running = bank.forward(tp_reduced(out, mixer.o_proj), running, layer.mlp_res_proj,
                                      layer.mlp_res_norm, layer.post_attention_layernorm)
            pending = batch.feed_forward(layer.mlp, h)

    def required(self, model, layout) -> list:
        def paths(layer_id):
            return _READS + ("self_attn.forward_qkvbfg",) + tuple(f"self_attn.{p}" for p in _MIXER)
        boundaries = [(model, "config.attn_res_block_size", "model"), (model, "attn_bank.current", "model")]
        boundaries += layer_requirements(model, [g.first_layer for g in layout.groups], ("attn_boundary.prepare",))
        return boundaries + replayed_layer_requirements(model, layout, paths, _FEED_FORWARD)


def prefix_read(model, forward_batch) -> torch.Tensor:
    """The prefix a group's first attention read formed, right after it: the running residual the boundary keeps,
    or, where that layer banks (and restarts the running residual), the row it banked."""
    residual = forward_batch.residual_stream.residual
    if residual is not None:
        return residual
    bank = model.attn_bank.current
    return bank.block_residual[:, bank.num_valid_blocks - 1]


FAMILY = AttnResKdaFamily()
