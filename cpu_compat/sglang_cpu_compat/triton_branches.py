"""Torch bodies for the CPU branches SGLang 0.5.23 sends to Triton kernels unless the CPU has AMX (Triton has no CPU
driver). `hooks.py` registers them as REPLACE hooks on CPUs without AMX only:

- `layernorm_gated.RMSNorm.forward` (Qwen3.5 GDN output norm; its Triton launcher also asks CUDA for an SM count),
- `fused_norm_gate.FusedRMSNormGated.forward` (Qwen3-Next GDN output norm),
- `elementwise.fused_gate_sigmoid_mul_add` (Qwen-MoE shared-expert gate): `fused.gate_sigmoid_mul_add_`.
"""

from sglang_cpu_compat import fused


def rmsnorm_gated_forward(self, x, z=None):
    if z is None or self.group_size is not None or not self.norm_before_gate:
        raise NotImplementedError("CPU gated RMSNorm supports norm-before-gate without groups (what Qwen3.5 uses)")
    return fused.gated_rmsnorm(x, self.weight, z, self.eps, self.activation)


def fused_rmsnorm_gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    if residual is not None or prenorm:
        raise NotImplementedError("CPU FusedRMSNormGated supports the residual-free form (what Qwen3-Next uses)")
    return fused.gated_rmsnorm(x, self.weight, g, self.eps, self.activation)
