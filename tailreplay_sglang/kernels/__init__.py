"""Kernels of the Tail-Replay pass, each a Triton kernel with a naive torch reference beside it.

- `gather`: tail hiddens from the hidden store (device or pinned host) into one packed varlen replay input.
- `conv`: causal conv1d of the replay, each tail's left context the conv state in its mamba slot; the new conv
  states written into the slots.
- `gdn`: GDN replay from the recurrent state in each tail's mamba slot, gating and q/k l2-norm fused, final states
  written back into the slots; `state_only=True` is the variant for a group's last GDN layer.
- `replay`: one GDN layer's replay (conv, then GDN): Triton for CUDA tensors, the torch ops of
  `tailreplay_sglang.ops` on CPU.

A slot holds zeros after SGLang cleared it (the paper's zero-init replay) or an anchor's states copied into it
(anchored replay: anchor prefix + tail then equal the whole sequence replayed from zero).
"""

from .conv import naive_replay_causal_conv1d, replay_causal_conv1d
from .gather import gather_tail_hiddens, naive_gather_tail_hiddens
from .gdn import gdn_replay_fwd, naive_gdn_gating, naive_gdn_replay
from .replay import (
    gdn_replay_torch,
    naive_replay_gdn_layer,
    replay_gdn_layer,
    replay_gdn_layer_torch,
    replay_gdn_layer_triton,
    split_qkv,
)

__all__ = [
    "gather_tail_hiddens", "naive_gather_tail_hiddens",
    "replay_causal_conv1d", "naive_replay_causal_conv1d",
    "gdn_replay_fwd", "naive_gdn_gating", "naive_gdn_replay",
    "replay_gdn_layer", "replay_gdn_layer_triton", "replay_gdn_layer_torch", "gdn_replay_torch",
    "naive_replay_gdn_layer", "split_qkv",
]
