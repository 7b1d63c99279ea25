"""The GDN replay's Triton kernels, each with a naive torch reference beside it (`kernels/README.md` at the repository
root describes them)."""

from .conv import naive_replay_causal_conv1d, replay_causal_conv1d
from .gdn import gdn_replay_fwd, naive_gdn_gating, naive_gdn_replay
from .replay import (
    CHUNK_KERNEL_FROM,
    gdn_replay,
    gdn_replay_chunk_kernel,
    gdn_replay_torch,
    naive_replay_gdn_layer,
    replay_gdn_layer,
    replay_gdn_layer_torch,
    replay_gdn_layer_triton,
    split_qkv,
)

__all__ = [
    "replay_causal_conv1d", "naive_replay_causal_conv1d",
    "gdn_replay_fwd", "naive_gdn_gating", "naive_gdn_replay",
    "replay_gdn_layer", "replay_gdn_layer_triton", "replay_gdn_layer_torch", "gdn_replay_torch",
    "gdn_replay", "gdn_replay_chunk_kernel", "CHUNK_KERNEL_FROM",
    "naive_replay_gdn_layer", "split_qkv",
]
