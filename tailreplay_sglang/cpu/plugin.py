"""SGLang plugin (`sglang.srt.plugins` entry point `tailreplay_cpu_ops`): torch paths for CPU branches that
SGLang 0.5.23 sends to Triton kernels unless the CPU has AMX (Triton has no CPU driver):

- `layernorm_gated.RMSNorm.forward` (Qwen3.5 GDN output norm; its Triton launcher also asks CUDA for an SM count),
- `fused_norm_gate.FusedRMSNormGated.forward` (Qwen3-Next GDN output norm),
- `elementwise.fused_gate_sigmoid_mul_add` (Qwen-MoE shared-expert gate).

It binds each rank's OpenMP threads to the cores SGLang resolved for it (`threads.py`): SGLang applies them only
through an AMX kernel.

It also replaces the `torch_native` backend's extend attention with one that computes only the new tokens' queries
(`extend_attention.py`): SGLang's recomputes every prefix position on every extend, so each cache hit paid a full
prefill's attention.

Registered only on CPU without AMX, so GPU and AMX CPU runs keep SGLang's own kernels.
"""

import logging

from tailreplay_sglang.cpu import extend_attention, fused, threads

logger = logging.getLogger(__name__)

_FLA = "sglang.kernels.ops.attention.fla"


def _rmsnorm_gated_forward(self, x, z=None):
    if z is None or self.group_size is not None or not self.norm_before_gate:
        raise NotImplementedError("CPU gated RMSNorm supports norm-before-gate without groups (what Qwen3.5 uses)")
    return fused.gated_rmsnorm(x, self.weight, z, self.eps, self.activation)


def _fused_rmsnorm_gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    if residual is not None or prenorm:
        raise NotImplementedError("CPU FusedRMSNormGated supports the residual-free form (what Qwen3-Next uses)")
    return fused.gated_rmsnorm(x, self.weight, g, self.eps, self.activation)


def torch_paths() -> dict[str, object]:
    """Dotted SGLang target -> replacement."""
    return {
        f"{_FLA}.layernorm_gated.RMSNorm.forward": _rmsnorm_gated_forward,
        f"{_FLA}.fused_norm_gate.FusedRMSNormGated.forward": _fused_rmsnorm_gated_forward,
        "sglang.kernels.ops.elementwise.elementwise.fused_gate_sigmoid_mul_add": fused.gate_sigmoid_mul_add_,
    }


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.utils import cpu_has_amx_support, is_cpu

    if not is_cpu() or cpu_has_amx_support():
        return
    for target, replacement in torch_paths().items():
        HookRegistry.register(target, replacement, HookType.REPLACE)
    # SGLang's torch_native extend attention recomputes every prefix position on every extend (extend_attention.py)
    HookRegistry.register(
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend",
        extend_attention.sdpa_forward_extend, HookType.AROUND)
    HookRegistry.register("sglang.srt.distributed.bootstrap._init_cpu_threads_env", threads.bind_rank_threads,
                          HookType.REPLACE)
    logger.info("tailreplay_sglang: torch paths for %d Triton-only CPU branches", len(torch_paths()))
