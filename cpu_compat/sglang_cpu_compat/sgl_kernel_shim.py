"""What `import sgl_kernel` gives on a CPU where SGLang's compiled kernel package cannot be imported.

SGLang 0.5.23 imports `sgl_kernel` on every device and, for hybrid GDN models on CPU, calls the ops below
unconditionally (`layers/attention/linear/gdn_backend.py`, `.../kernels/gdn_triton.py`, `models/qwen3_5.py`).
sgl-kernel's CPU build needs AVX-512/AMX and is not on PyPI, so we provide the same entry points in pure torch:
`sgl_kernel.mamba.*` as Python functions and `torch.ops.sgl_kernel.*` as registered torch custom ops (SGLang
calls some of them with keyword arguments, so the schemas keep SGLang's argument names).

Any other attribute resolves to a stub that raises when called: SGLang imports many GPU-only names at module
level that the CPU path never calls, and a clear error beats an ImportError at start-up.
"""

import ctypes
from typing import Optional

import torch

from sglang_cpu_compat import fused, spec_kernels
from sglang_cpu_compat.ops import spec_verify
from tailreplay_sglang.ops import conv, gdn

_LIB = "sgl_kernel"


class UnavailableKernel:
    """Placeholder for a compiled sgl_kernel op this CPU build does not provide."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{self.name} is a compiled GPU/AMX kernel; sglang_cpu_compat's CPU fallback provides only "
            f"the ops needed to serve Qwen3.5 / Qwen3-Next on CPU (see sglang_cpu_compat/sgl_kernel_shim.py)"
        )

    def __repr__(self):
        return f"<UnavailableKernel sgl_kernel.{self.name}>"


# ---- sgl_kernel.mamba (plain Python functions, called positionally or by keyword) ----

def causal_conv1d_fn_cpu(mixed_qkv_transposed, conv_weights, bias, activation, conv_states, has_initial_state,
                         cache_indices, query_start_loc, seq_lens_cpu=None, **unused):
    return conv.causal_conv1d_fwd(mixed_qkv_transposed, conv_weights, bias, conv_states, query_start_loc,
                                  cache_indices, has_initial_state, activation)


def causal_conv1d_update_cpu(mixed_qkv, conv_states, conv_weights, bias, activation, conv_state_indices=None,
                             intermediate_conv_window=None, intermediate_state_indices=None,
                             retrieve_next_token=None, retrieve_next_sibling=None, retrieve_parent_token=None,
                             **unused):
    if intermediate_conv_window is not None:  # speculative decoding's target verify (`gdn_backend.py`)
        return spec_verify.causal_conv1d_verify(
            mixed_qkv, conv_states, conv_weights, bias, activation, conv_state_indices, intermediate_conv_window,
            intermediate_state_indices, retrieve_next_token, retrieve_next_sibling, retrieve_parent_token)
    if retrieve_next_token is not None:  # a draft tree without its windows would commit wrong conv states, silently
        raise NotImplementedError("causal_conv1d_update_cpu: a draft tree needs intermediate_conv_window")
    return conv.causal_conv1d_update(mixed_qkv, conv_states, conv_weights, bias, activation, conv_state_indices)


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, cu_seqlens, head_first=False,
                               use_qk_l2norm_in_kernel=False, initial_state_indices=None, **unused):
    """(o, final states, h): the per-chunk states `h` too, as fla's chunk kernel returns them on a GPU (SGLang's
    extra_buffer tracking and Tail-Replay's interval anchors read them)."""
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule_cpu: head_first=True is not supported")
    return gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, initial_state_indices,
                                      use_qk_l2norm_in_kernel, chunk_states=True)


MAMBA_FUNCTIONS = {f.__name__: f for f in (causal_conv1d_fn_cpu, causal_conv1d_update_cpu, chunk_gated_delta_rule_cpu)}


# ---- sgl_kernel (plain Python functions) ----

def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """Row `src_loc[i]` -> row `tgt_loc[i]` in every layer's KV buffer, given as raw addresses and row strides in
    bytes (`MHATokenToKVPool.move_kv_cache`: speculative decoding moves accepted draft tokens' KV). All sources are
    read before any target is written, as the Triton kernel's tiles are (safe in place)."""
    if tgt_loc.numel() == 0:
        return
    rows = int(torch.maximum(tgt_loc.max(), src_loc.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        buffer = (ctypes.c_uint8 * (rows * stride)).from_address(address)
        table = torch.frombuffer(buffer, dtype=torch.uint8).view(rows, stride)
        table[tgt_loc.long()] = table[src_loc.long()]


SPECULATIVE_FUNCTIONS = {"reconstruct_indices_from_tree_mask": spec_kernels.reconstruct_indices_from_tree_mask}
FUNCTIONS = {copy_all_layer_kv_cache_cpu.__name__: copy_all_layer_kv_cache_cpu, **spec_kernels.FUNCTIONS}


# ---- torch.ops.sgl_kernel.* ----

def register_torch_ops() -> None:
    """Define the sgl_kernel ops SGLang reaches through torch.ops on CPU (idempotent)."""
    if hasattr(torch.ops, _LIB) and _has_op("fused_gdn_gating_cpu"):
        return

    @torch.library.custom_op(f"{_LIB}::fused_gdn_gating_cpu", mutates_args=())
    def fused_gdn_gating_cpu(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                             dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gdn.gdn_gating(A_log, a, b, dt_bias)

    @torch.library.custom_op(f"{_LIB}::fused_sigmoid_gating_delta_rule_update_cpu",
                             mutates_args=("initial_state_source", "intermediate_states_buffer"))
    def fused_sigmoid_gating_delta_rule_update_cpu(
        A_log: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        a: torch.Tensor, b: torch.Tensor, initial_state_source: torch.Tensor, initial_state_indices: torch.Tensor,
        cu_seqlens: Optional[torch.Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
        softplus_beta: float = 1.0, softplus_threshold: float = 20.0, is_kda: bool = False,
        disable_state_update: bool = False, intermediate_states_buffer: Optional[torch.Tensor] = None,
        intermediate_state_indices: Optional[torch.Tensor] = None, cache_steps: Optional[int] = None,
        retrieve_parent_token: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if is_kda:
            raise NotImplementedError("KDA is served by sglang_cpu_compat.kda, not this op")
        if intermediate_states_buffer is not None or disable_state_update:  # speculative decoding's target verify
            return spec_verify.recurrent_gated_delta_rule_verify(
                A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices, cu_seqlens,
                intermediate_states_buffer, intermediate_state_indices, retrieve_parent_token, disable_state_update,
                use_qk_l2norm_in_kernel, softplus_beta, softplus_threshold)
        return gdn.recurrent_gated_delta_rule_update(
            A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices, cu_seqlens,
            use_qk_l2norm_in_kernel, softplus_beta, softplus_threshold)

    @torch.library.custom_op(f"{_LIB}::fused_sigmoid_mul_cpu", mutates_args=("x",))
    def fused_sigmoid_mul_cpu(x: torch.Tensor, gate: torch.Tensor) -> None:
        fused.fused_sigmoid_mul_(x, gate)

    @torch.library.custom_op(f"{_LIB}::fused_qk_gemma_rmsnorm_cpu", mutates_args=())
    def fused_qk_gemma_rmsnorm_cpu(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                                   eps: float, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return fused.fused_qk_gemma_rmsnorm(q, k, q_weight, k_weight, eps, head_dim)

    @torch.library.custom_op(f"{_LIB}::fused_qk_gemma_rmsnorm_with_gate_cpu", mutates_args=())
    def fused_qk_gemma_rmsnorm_with_gate_cpu(
        q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
        eps: float, head_dim: int, num_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return fused.fused_qk_gemma_rmsnorm_with_gate(q_gate, k, q_weight, k_weight, eps, head_dim, num_heads)

    @torch.library.custom_op(f"{_LIB}::fused_qkvzba_split_reshape_cat_contiguous_cpu", mutates_args=())
    def fused_qkvzba_split_reshape_cat_contiguous_cpu(
        mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor, num_heads_qk: int, num_heads_v: int,
        head_qk: int, head_v: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return fused.qkvzba_split_contiguous(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v)


def _has_op(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, _LIB), name)
        return True
    except (AttributeError, RuntimeError):
        return False
