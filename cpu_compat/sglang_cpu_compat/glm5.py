"""GLM-5.3-Flash (`Glm5NextForConditionalGeneration`: KDA and DSA-indexed MLA layers under mHC streams) on SGLang's
CPU engine. docs/frontier-plan.md, section 4, is the reading behind each piece:

- the launcher's DSA steps ask CUDA for its device capability (`model_hook.py`, `overrides.py`), and one of them
  forces a bfloat16 KV pool whatever the model's dtype;
- the DSA indexer (`IndexerKPool`) has no CPU forward. Its GPU body returns no top-k indices when the attention
  backend gives it no indexer metadata, which `torch_native` does not, and attention is then dense: what GLM computes
  while a request holds at most `index_topk` tokens (2048 as published), every token's pool being selected;
- the dense MLP and shared experts clamp their SwiGLU (`swiglu_limit`) in a CUDA JIT kernel;
- `DeepseekV2MoE` scales its routed output by `routed_scaling_factor` itself off CUDA, so the MoE row of `moe.py`
  must not scale it again, and its routed experts clamp their SwiGLU as the dense ones do.

mHC's pre and post run SGLang's own torch paths with its TileLang flags off (`env.default_mhc_torch_paths`).
"""

import contextlib
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)
_SCALED_BY_BLOCK = "_tailreplay_routed_scale_in_block"


def launcher_without_cuda(original, *args, **kwargs):
    """AROUND `handle_model_specific_adjustments`: its DSA branch, and the two DSA passes it runs, call
    `torch.cuda.get_device_capability()`, which a CPU-only torch refuses; they read no capability here (0, 0)."""
    with _capability((0, 0)):
        return original(*args, **kwargs)


@contextlib.contextmanager
def _capability(value):
    saved = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *args, **kwargs: value
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved


def kv_dtype_as_served(view) -> dict:
    """REPLACE `_dsa_kv_cache_dtype_default`: keep the KV pool in the served dtype (`--kv-cache-dtype auto`), where
    the GPU default forces bfloat16 (or fp8 on SM100) and refuses float32; torch_native reads K and V in the query's
    dtype."""
    return {}


def indexer_forward_native(self, x, q_lora, positions, forward_batch, layer_id, *args, **kwargs):
    """REPLACE `IndexerKPool.forward_native`: no top-k indices, as the GPU body returns where the attention backend
    has no indexer metadata, so the layer attends densely: exact up to `index_topk` tokens per request (GLM selects
    every pool up to there); past it GLM's sparse selection is not run, which a warning says once."""
    if not getattr(self, "_tailreplay_warned", False) and forward_batch.seq_lens_cpu is not None:
        if int(forward_batch.seq_lens_cpu.max()) > self.index_topk:
            logger.warning("CPU port: a request is longer than index_topk (%d); the DSA indexer's sparse selection "
                           "is not run on a CPU, so attention stays dense", self.index_topk)
            self._tailreplay_warned = True
    return None


def silu_and_mul_clamp(input: torch.Tensor, output: torch.Tensor, swiglu_limit: float) -> None:
    """REPLACE SGLang's CUDA JIT `silu_and_mul_clamp` (the dense MLP's and shared experts' clamped SwiGLU): gate
    clamped from above, up both ways, in the input's dtype as the kernel clamps, then silu(gate) * up in float32."""
    gate, up = input.chunk(2, dim=-1)
    output.copy_(F.silu(gate.clamp(max=swiglu_limit).float()) * up.clamp(-swiglu_limit, swiglu_limit).float())


def mark_routed_scale_in_block(result, self, *args, **kwargs) -> None:
    """AFTER `DeepseekV2MoE.__init__`: its experts' routed output is scaled by the block itself off CUDA."""
    setattr(self.experts, _SCALED_BY_BLOCK, True)


def routed_scale_in_block(layer) -> bool:
    return getattr(layer, _SCALED_BY_BLOCK, False)


def clamped_swiglu(limit: float):
    """GLM's routed-expert activation over gate | up halves, as HF's `_apply_gate`."""
    def activation(gate_up: torch.Tensor) -> torch.Tensor:
        out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
        silu_and_mul_clamp(gate_up, out, limit)
        return out
    return activation
