"""Torch bodies for the CPU branches SGLang 0.5.23 sends to Triton kernels unless the CPU has AMX (Triton has no CPU
driver). `hooks.py` registers them as REPLACE hooks on CPUs without AMX only:

- `layernorm_gated.RMSNorm.forward` (Qwen3.5 GDN output norm, Ling-2.5's grouped sigmoid-gated lightning output norm;
  its Triton launcher also asks CUDA for an SM count),
- `fused_norm_gate.FusedRMSNormGated.forward` (Qwen3-Next GDN output norm),
- `layernorm_gated.layernorm_fn` (the function behind `RMSNorm.forward`; Ling-2.5's q/k norm calls it directly),
- `elementwise.fused_gate_sigmoid_mul_add` (Qwen-MoE shared-expert gate): `fused.gate_sigmoid_mul_add_`.
"""

from sglang_cpu_compat import fused


def rmsnorm_gated_forward(self, x, z=None):
    if not self.norm_before_gate:
        raise NotImplementedError("CPU gated RMSNorm supports norm-before-gate (Qwen3.5's GDN and Ling-2.5's "
                                  "lightning output norms)")
    return fused.gated_rmsnorm(x, self.weight, z, self.eps, self.activation, self.group_size,
                               getattr(self, "bias", None))


def fused_rmsnorm_gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    if residual is not None or prenorm:
        raise NotImplementedError("CPU FusedRMSNormGated supports the residual-free form (what Qwen3-Next uses)")
    return fused.gated_rmsnorm(x, self.weight, g, self.eps, self.activation)


def layernorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, is_rms_norm=False,
                 activation="swish"):
    """fla's `layernorm_fn` in its RMSNorm forms (Ling-2.5's per-head q/k norm calls it directly)."""
    if not is_rms_norm or not norm_before_gate:
        raise NotImplementedError("CPU layernorm_fn supports the RMSNorm, norm-before-gate forms")
    return fused.gated_rmsnorm(x, weight, z, eps, activation, group_size, bias)
