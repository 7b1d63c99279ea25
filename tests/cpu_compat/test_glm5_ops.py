"""The CPU port's GLM-5.3-Flash ops (`sglang_cpu_compat.glm5`) against transformers' GLM-5-Next: the clamped SwiGLU
of the dense MLP, shared and routed experts (the tiny test model's activations never reach its limit, so the
server tests cannot see a missing clamp)."""

import pytest
import torch

from sglang_cpu_compat import glm5


def hf_clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """transformers' `Glm5NextTextExperts._apply_gate` (the MLP's forward clamps the same way)."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextExperts

    return Glm5NextTextExperts._apply_gate(type("Experts", (), {"swiglu_limit": limit})(), gate_up)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_clamped_swiglu_equals_hfs_past_the_limit(dtype, tol):
    torch.manual_seed(0)
    limit = 10.0
    gate_up = (torch.randn(64, 2 * 48) * 12).to(dtype)  # about 40 % of the entries past the limit
    assert (gate_up.abs() > limit).float().mean() > 0.3
    expected = hf_clamped_swiglu(gate_up.float(), limit)
    out = torch.empty(64, 48, dtype=dtype)
    glm5.silu_and_mul_clamp(gate_up, out, limit)
    assert torch.allclose(out.float(), expected, rtol=tol, atol=tol * expected.abs().max())
    assert torch.allclose(glm5.clamped_swiglu(limit)(gate_up).float(), out.float())
    unclamped = torch.nn.functional.silu(gate_up.float()[:, :48]) * gate_up.float()[:, 48:]
    assert not torch.allclose(out.float(), unclamped, rtol=0.1)


def test_a_marked_moe_block_is_scaled_once():
    """`DeepseekV2MoE` scales its routed output itself off CUDA: the port's MoE row leaves layers it marked alone."""
    experts = torch.nn.Module()
    assert not glm5.routed_scale_in_block(experts)
    glm5.mark_routed_scale_in_block(None, type("MoE", (), {"experts": experts})())
    assert glm5.routed_scale_in_block(experts)
