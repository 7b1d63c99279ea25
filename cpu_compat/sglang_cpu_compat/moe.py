"""What SGLang's MoE layers get wrong on a CPU without AMX: the routed-expert scale, Nemotron-H's squared-ReLU
experts and its router GEMM.

On a CPU without AMX, `UnquantizedFusedMoEMethod.forward_cpu` runs `fused_moe_native.moe_forward_native`, which
never applies `moe_runner_config.routed_scaling_factor`; the Triton runner a GPU takes multiplies the routed sum by
it (Kimi Linear's is 2.446): without it the routed experts' share of every MoE layer's output is off by that factor
(what it costs against HF: docs/cpu.md).

Under expert parallelism (`--ep-size`) the top-k ids are mapped to this rank's experts and a slot routed to another
rank's expert holds -1; `moe_forward_native` scatters by id and fails on it ("index -1 is out of bounds"). Such a
batch runs the local experts here (`routed_experts`): each rank returns its experts' share, and the EP reduction
sums them.
"""

import torch
import torch.nn.functional as F

from sglang_cpu_compat import glm5


def scale_routed_output(original, layer, x, topk_output, moe_runner_config):
    """AROUND hook on `moe_forward_native` (same arguments, same output); also runs the squared-ReLU experts it does
    not know and the expert-parallel batches it fails on (`routed_experts`)."""
    limit = getattr(moe_runner_config, "swiglu_limit", None)
    if moe_runner_config.activation == "relu2" and not moe_runner_config.is_gated:
        out = routed_experts(layer, x, topk_output, lambda h: torch.relu(h).square())
    elif limit is not None:  # GLM-5.3-Flash's clamped SwiGLU, which `moe_forward_native` does not apply
        out = routed_experts(layer, x, topk_output, glm5.clamped_swiglu(limit))
    elif bool((topk_output.topk_ids < 0).any()):
        out = routed_experts(layer, x, topk_output, gated_activation(moe_runner_config))
    else:
        out = original(layer, x, topk_output, moe_runner_config)
    factor = moe_runner_config.routed_scaling_factor
    if (factor is not None and factor != 1.0 and not getattr(layer, "should_fuse_routed_scaling_factor_in_topk", False)
            and not glm5.routed_scale_in_block(layer)):  # DeepseekV2MoE scales off CUDA itself
        out = out * factor
    return out


def gated_activation(moe_runner_config):
    """The gated activation `moe_forward_native` applies to an expert's up projection (gate and up halves)."""
    from sglang.srt.layers.activation import GeluAndMul, SiluAndMul

    acts = {"silu": SiluAndMul, "gelu": GeluAndMul}
    if moe_runner_config.activation not in acts or moe_runner_config.gemm1_alpha is not None:
        raise NotImplementedError(f"expert parallelism on a CPU: activation {moe_runner_config.activation!r}")
    return acts[moe_runner_config.activation]()


def routed_experts(layer, x, topk_output, activation) -> torch.Tensor:
    """This rank's routed experts, one at a time: up projection, `activation`, down projection, weighted sum. Slots
    routed to no local expert (id -1, another expert-parallel rank's) add nothing. Nemotron-H's squared ReLU without
    a gate (`moe_forward_native` knows only gated ones: "Unsupported activation ... 'relu2'") and expert-parallel
    batches go through here."""
    weights, ids, _ = topk_output
    w13_bias, w2_bias = getattr(layer, "w13_weight_bias", None), getattr(layer, "w2_weight_bias", None)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        if expert < 0:
            continue
        rows, slot = (ids == expert).nonzero(as_tuple=True)
        up = F.linear(x[rows], layer.w13_weight[expert])
        if w13_bias is not None:
            up = (up.float() + w13_bias[expert]).to(x.dtype)
        down = F.linear(activation(up), layer.w2_weight[expert]).float()
        if w2_bias is not None:
            down = down + w2_bias[expert]
        out.index_add_(0, rows, down * weights[rows, slot, None].float())
    return out.to(x.dtype)


def nemotron_h_moe_core(self, hidden_states):
    """REPLACE of `NemotronHMoE._forward_core_normal` (Nemotron-H's MoE stages, the path a CPU takes): SGLang's body,
    but the router GEMM in float32 by casting, since `torch.mm(..., out_dtype=torch.float32)` ("bf16 gemm with fp32
    accumulation/output") has no CPU kernel ("Could not run 'aten::mm.dtype' with arguments from the 'CPU'
    backend"): the first MoE stage killed the scheduler."""
    router_logits = torch.mm(hidden_states.float(), self.gate.weight.float().t())
    shared_output = self.shared_experts(hidden_states) if self.shared_experts is not None else None
    topk_output = self.topk(hidden_states, router_logits)
    if self.use_latent_moe:
        hidden_states = self._apply_fc1_latent_proj(hidden_states)
    return self.experts(hidden_states, topk_output), shared_output
