"""LFM2's decode conv on SGLang's CPU engine.

LFM2's short-conv layers (`models/lfm2.py`) run their decode step through SGLang's Triton `causal_conv1d_update`
(`sglang.kernels.ops.mamba.causal_conv1d_triton`, reached through `layers/attention/mamba/causal_conv1d.py` off
CUDA), which has no CPU driver: "0 active drivers". Their prefill conv is the same module's `causal_conv1d_fn`, which
the KDA row already replaces. Here the update is the plugin's torch conv step in the Triton kernel's signature.
"""

from tailreplay_sglang.ops import conv


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None, num_accept_tokens=None, intermediate_conv_window=None, **unused):
    """A decode step over each sequence's slot: x [B, dim] (or [B, dim, T]) shifted into its conv state."""
    if cache_seqlens is not None or num_accept_tokens is not None or intermediate_conv_window is not None:
        raise NotImplementedError("CPU causal_conv1d_update: circular buffers and speculative verify are not "
                                  "supported")
    return conv.causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices)
