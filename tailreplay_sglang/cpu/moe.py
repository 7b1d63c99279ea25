"""The routed-expert scale SGLang's CPU MoE path drops.

On a CPU without AMX, `UnquantizedFusedMoEMethod.forward_cpu` runs `fused_moe_native.moe_forward_native`, which
never applies `moe_runner_config.routed_scaling_factor`; the Triton runner a GPU takes multiplies the routed sum by
it. Kimi Linear's is 2.446 (DeepSeek-V3's 2.5): without it the routed experts' share of every MoE layer's output is
off by that factor, and stock prompt log-probs differed from HF's by 0.085 nats on the tiny Kimi Linear (4e-5
with it).
"""


def scale_routed_output(original, layer, x, topk_output, moe_runner_config):
    """AROUND hook on `moe_forward_native` (same arguments, same output)."""
    out = original(layer, x, topk_output, moe_runner_config)
    factor = moe_runner_config.routed_scaling_factor
    if factor is not None and factor != 1.0 and not getattr(layer, "should_fuse_routed_scaling_factor_in_topk", False):
        out = out * factor
    return out
