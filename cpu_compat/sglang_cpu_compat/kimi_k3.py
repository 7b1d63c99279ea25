"""Kimi K3 (`models/kimi_k3.py`) on SGLang's CPU engine: two GPU-only points its forward reaches.

- `KimiK3LinearModel.__init__` builds three `torch.cuda.Stream`s for its layers' side work unless it runs on HIP;
  a CPU-only torch raises there, so the model cannot be built. On a CPU the layers get none, as on HIP.
- Off CUDA and HIP every attention-residual read (`layers/attn_residual.py`) mixes the bank with the Triton score
  and combine kernels (`_mix_fused`). On a CPU it is SGLang's own eager reference, `aggregate_stream_torch`.
"""

import torch


def model_without_streams(original, model, *args, **kwargs):
    """AROUND `KimiK3LinearModel.__init__`: built with no side streams (its layers then take the HIP branch's None)."""
    stream, torch.cuda.Stream = torch.cuda.Stream, _no_stream
    try:
        original(model, *args, **kwargs)
    finally:
        torch.cuda.Stream = stream
    model.alt_streams = None


def _no_stream(*args, **kwargs):
    return None


def mix_fused(prefix_sum, bank, nvb, score_proj, score_norm):
    """`attn_residual._mix_fused` (the pre-norm mixture of the bank's first `nvb` rows and `prefix_sum`), eager."""
    from sglang.srt.layers.attn_residual import aggregate_stream_torch

    if prefix_sum.shape[0] == 0:
        return prefix_sum
    return aggregate_stream_torch(prefix_sum, bank, nvb, score_proj, score_norm)
