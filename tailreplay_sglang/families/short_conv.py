"""LFM2's gated short convolution (`Lfm2ForCausalLM`, `Lfm2MoeForCausalLM`): a conv-only state, rebuilt exactly from
a few tokens.

An LFM2 conv layer is norm -> in_proj -> (B, C, x) -> conv over B * x -> C * conv -> out_proj, then a SwiGLU MLP;
its state is the last K - 1 rows of B * x (K = `conv_L_cache`), nothing else. A group of n conv layers (the
attention layers between groups keep their KV) therefore depends on its last (K - 1) * n inputs only: replayed from
a zero state over that many tokens, layer 1's outputs are exact from its (K - 1)-th token on, which is all layer 2's
state needs, and so on. So every hit replays `state_window` tokens from a cleared slot and is exact at any token
boundary: no anchors, no stored states, no survival bound (`config.state_window`, set by the launcher).

The mixer is replayed through the model's own projections, norms and conv weights, and through the unfused conv
kernel its module calls (`causal_conv1d_fn` of `models/lfm2.py` or `models/lfm2_moe.py`: Triton on a GPU, the CPU
port's torch conv here; LFM2-MoE's fused bfloat16 kernel computes the same conv), with no initial state, which
writes each tail's conv state into its slot. The feed-forward block is a dense MLP or LFM2-MoE's MoE, each reduced
over TP inside.
"""

import sys
from typing import NamedTuple

import torch

from tailreplay_sglang import capture
from tailreplay_sglang.families.base import Family, ReplayBatch, layer_requirements

_CONV_KERNEL = "causal_conv1d_fn"  # as the conv layer's own model module binds it
_LAYER = ("operator_norm", "ffn_norm", "feed_forward", "conv.in_proj", "conv.out_proj", "conv.conv_weight")


def conv_kernel_module(layer):
    """The model module that defines the layer's conv class (and binds the conv kernel it calls)."""
    return sys.modules[type(layer.conv).__module__]


class ShortConvFamily(Family):
    name = "short_conv"

    def state_window(self, layout) -> int | None:
        """Tokens a zero-init replay needs for every group's state to be exact: (K - 1) x the most conv layers in a
        group."""
        return (layout.conv_kernel - 1) * max(len(group.recurrent_layers) for group in layout.groups)

    def install_capture(self, model, store) -> list:
        return capture.at_layer_keyword_inputs(model.layers, store)

    def replay_group(self, model, pool, group, x: torch.Tensor, batch: ReplayBatch) -> None:
        """The group's conv layers in order; the last one computes only its state."""
        kernel = batch.pass_state.get(self.name)
        if kernel is None:  # the same for every group of the pass: built once
            kernel = batch.pass_state[self.name] = ConvKernel(
                getattr(conv_kernel_module(model.layers[group.recurrent_layers[0]]), _CONV_KERNEL),
                batch.cu_seqlens.to(torch.int32),
                torch.zeros(len(batch.tail_lens), dtype=torch.bool, device=x.device))
        for layer_id in group.recurrent_layers:
            last = layer_id == group.recurrent_layers[-1]
            conv_state = pool.mamba2_layer_cache(layer_id).conv[0]
            x = replay_layer(model.layers[layer_id], kernel, conv_state, x, batch, last)

    def required(self, model, layout) -> list:
        layers = [i for g in layout.groups for i in g.recurrent_layers]
        needs = layer_requirements(model, layers, _LAYER)
        if hasattr(model.layers[layers[0]], "conv"):
            module = conv_kernel_module(model.layers[layers[0]])
            needs.append((module, _CONV_KERNEL, module.__name__))
        return needs


class ConvKernel(NamedTuple):
    """The conv kernel of a replay pass and the arguments every group passes it alike."""

    fn: object  # causal_conv1d_fn as the model module binds it
    query_start_loc: torch.Tensor  # [n + 1] int32 cu_seqlens
    has_initial_state: torch.Tensor  # [n] all False: every tail starts from a cleared slot


def replay_layer(layer, kernel: ConvKernel, conv_state, x: torch.Tensor, batch: ReplayBatch, state_only: bool):
    """One LFM2 conv layer over the packed tails from a zero state; its conv state lands in the requests' slots.
    Returns the next residual-stream value, or None when only the state was needed."""
    conv = layer.conv
    proj, _ = conv.in_proj(layer.operator_norm(x))
    gate_b, gate_c, value = proj.chunk(3, dim=-1)
    out = kernel.fn((gate_b * value).transpose(0, 1).contiguous(), conv.conv_weight, conv.conv_bias,
                    query_start_loc=kernel.query_start_loc, cache_indices=batch.mamba_slots,
                    has_initial_state=kernel.has_initial_state, conv_states=conv_state,
                    activation=None).transpose(0, 1)
    if state_only:
        return None
    mixed, _ = conv.out_proj(gate_c * out)  # RowParallelLinear: reduced over TP inside
    x = x + mixed
    return x + batch.feed_forward(layer.feed_forward, layer.ffn_norm(x))


FAMILY = ShortConvFamily()
