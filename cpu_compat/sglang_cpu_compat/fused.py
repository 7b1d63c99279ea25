"""Small fused elementwise/norm ops SGLang's Qwen3.5 / Qwen3-Next code calls on CPU, in plain torch.

Each mirrors the GPU (Triton) op of the same name in sglang 0.5.23; math in float32, results in the input dtype.
"""

import torch
import torch.nn.functional as F


def gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma-style RMSNorm: x / rms(x) * (1 + weight)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def gated_rmsnorm(x, weight, gate, eps: float, activation: str = "silu", group_size: int | None = None,
                  bias: torch.Tensor | None = None):
    """(norm(x) * weight + bias) * act(gate), the norm before the gate: the GDN output norm; over groups of
    `group_size` channels where given (Ling-2.5's lightning output norm), and with no gate where `gate` is None."""
    xf = x.float()
    grouped = xf if group_size is None else xf.unflatten(-1, (-1, group_size))
    normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).reshape(x.shape)
    normed = normed.to(x.dtype) * weight if bias is None else normed.to(x.dtype) * weight + bias
    if gate is None:
        return normed
    act = F.silu(gate.float()) if activation in ("silu", "swish") else gate.float().sigmoid()
    return (normed.float() * act).to(x.dtype)


def fused_sigmoid_mul_(x: torch.Tensor, gate: torch.Tensor) -> None:
    """x *= sigmoid(gate), in place."""
    x.copy_((x.float() * gate.float().sigmoid()).to(x.dtype))


def fused_qk_gemma_rmsnorm(q, k, q_weight, k_weight, eps: float, head_dim: int):
    """Per-head Gemma RMSNorm of q and k. Returns ([rows_q, head_dim], [rows_k, head_dim]), contiguous."""
    return (gemma_rmsnorm(q.reshape(-1, head_dim), q_weight, eps),
            gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps))


def fused_qk_gemma_rmsnorm_with_gate(q_gate, k, q_weight, k_weight, eps: float, head_dim: int, num_heads: int):
    """q_gate: [T, num_heads * 2 * head_dim] interleaved per head as [q_h, gate_h]. Returns (q, k, gate) by head."""
    per_head = q_gate.reshape(q_gate.shape[0], num_heads, 2, head_dim)
    q, gate = per_head[:, :, 0], per_head[:, :, 1]
    q_out, k_out = fused_qk_gemma_rmsnorm(q, k, q_weight, k_weight, eps, head_dim)
    return q_out, k_out, gate.reshape(-1, head_dim).clone()


def qkvzba_split_contiguous(mixed_qkvz, mixed_ba, num_heads_qk: int, num_heads_v: int, head_qk: int, head_v: int):
    """Qwen3.5 contiguous projections: qkvz = [q | k | v | z], ba = [b | a].

    Returns fresh tensors (mixed_qkv [T, 2*H*Dk + HV*Dv], z [T, HV, Dv], b [T, HV], a [T, HV]).
    """
    qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    T = mixed_qkvz.shape[0]
    mixed_qkv = mixed_qkvz[:, :qkv_dim].clone()
    z = mixed_qkvz[:, qkv_dim:].reshape(T, num_heads_v, head_v).clone()
    b, a = mixed_ba[:, :num_heads_v].clone(), mixed_ba[:, num_heads_v:].clone()
    return mixed_qkv, z, b, a


def gate_sigmoid_mul_add_(hidden_states, gate_weight, shared_output, final_hidden_states) -> None:
    """final += sigmoid(hidden @ gate_weight) * shared_output (Qwen-MoE shared-expert gate), in place."""
    gate = (hidden_states.float() @ gate_weight.float().reshape(-1, 1)).sigmoid()
    final_hidden_states.add_((gate * shared_output.float()).to(final_hidden_states.dtype))
