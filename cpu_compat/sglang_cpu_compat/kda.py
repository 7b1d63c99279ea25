"""KDA's ops for SGLang's CPU engine: Kimi Linear's `TritonKDAKernel` imports its prefill
(`chunk_kda`) and decode (`fused_sigmoid_gating_delta_rule_update`) kernels only off CPU, so on a CPU the first KDA
forward fails on an unbound name; its prefill conv is the Triton `causal_conv1d_fn` on every device.

`install` (a `call` row of `hooks.CPU_ENGINE`) binds the two kernel names to torch bodies (`ops/kda.py`) with the
argument names and return shapes of SGLang's kernels; the Triton conv is a `replace` row at its defining module
(`causal_conv1d_fn`: the GDN path's CPU conv in the Triton kernel's argument order).
"""

from sglang_cpu_compat.ops import kda
from sglang_cpu_compat.ops.spec_verify import recurrent_kda_verify
from tailreplay_sglang.ops import conv

KERNEL_MODULE = "sglang.srt.layers.attention.linear.kernels.kda_triton"


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, initial_state_indices=None,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=None,
              output_intermediate_states=False, track_state=None, track_chunk_idx=None, beta_is_raw=False,
              **unused):
    """SGLang's `chunk_kda`: o, or (o, h) with `output_intermediate_states` (h [1, NT, HV, V, K], the state entering
    each 64-token chunk of each sequence, which extra_buffer's tracking reads). `track_state[n]` gets sequence n's
    state entering its chunk `track_chunk_idx[n]` (-1: none), as the Triton kernel snapshots it."""
    o, _, h = kda.chunk_kda(q, k, v, g, beta, initial_state, cu_seqlens, initial_state_indices,
                            use_qk_l2norm_in_kernel, scale, A_log, dt_bias, lower_bound, beta_is_raw,
                            chunk_states=True)
    if track_state is not None:
        _snapshot(h[0], cu_seqlens, track_chunk_idx, track_state)
    return (o, h) if output_intermediate_states else o


def _snapshot(h, cu_seqlens, track_chunk_idx, track_state) -> None:
    cu = cu_seqlens.tolist()
    first = 0  # row of h where sequence n's chunks start
    for n, index in enumerate(track_chunk_idx.tolist()):
        if index >= 0:
            track_state[n] = h[first + index]
        first += -(-(cu[n + 1] - cu[n]) // kda.CHUNK_SIZE)


def fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                          initial_state_indices, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                                          is_kda=False, lower_bound=None, **options):
    if not is_kda:
        raise NotImplementedError("CPU KDA kernel module: the GDN decode goes through sgl_kernel_shim")
    if options.get("disable_state_update"):  # a speculative verify: every draft step's state to the scratch buffer
        return recurrent_kda_verify(A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices,
                                    cu_seqlens, options.get("intermediate_states_buffer"),
                                    options.get("intermediate_state_indices"), options.get("retrieve_parent_token"),
                                    True, use_qk_l2norm_in_kernel, lower_bound)
    if options.get("target_verify"):
        raise NotImplementedError("CPU KDA decode: a verify that commits its states is not SGLang's")
    return kda.recurrent_kda_update(A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices,
                                    cu_seqlens, use_qk_l2norm_in_kernel, lower_bound)


def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, seq_lens_cpu, cache_indices=None,
                     has_initial_state=None, activation="silu", **unused):
    """SGLang's Triton prefill conv (a `replace` row at its defining module; KDA's backend imports it from there), in
    its argument order: the GDN path's CPU conv. Called through `ops.conv`, not `sgl_kernel_shim`'s name, which
    SGLang's hook registry rebinds when it wraps the GDN backend's conv (interval anchors)."""
    return conv.causal_conv1d_fwd(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                                  activation)


def install() -> None:
    """`call` row: bind the kernel module's two names (imported there only off CPU)."""
    import importlib

    kernels = importlib.import_module(KERNEL_MODULE)
    kernels.chunk_kda = chunk_kda
    kernels.fused_sigmoid_gating_delta_rule_update = fused_sigmoid_gating_delta_rule_update

