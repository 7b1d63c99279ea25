"""One GDN layer's replay over a packed batch of tails: conv, then the delta rule, each tail from its slot's states.

`replay_gdn_layer` is what the replay pass calls for every GDN layer of a group (with `state_only=True` for the
group's last one, whose outputs nobody reads). CUDA tensors go through the Triton kernels of this package; CPU
tensors through the torch ops of `tailreplay_sglang.ops` (chunked, not per token), so the same pass runs on any CPU.
Layer sizes come from the pool shapes: `ssm_states` is `[slots, HV, V, K]` and `mixed_qkv` packs q | k | v as
SGLang does (`conv_dim = 2 H K + HV V`).

Each tail starts from the conv and recurrent states in its mamba slot: zeros after SGLang cleared it (the paper's
zero-init replay), or an anchor's states copied into it (anchored replay, then exact: anchor prefix + tail give the
same outputs and final states as the whole sequence from zero).
"""

import torch

from tailreplay_sglang.ops import conv as cpu_conv
from tailreplay_sglang.ops import gdn as cpu_gdn

from .conv import naive_replay_causal_conv1d, replay_causal_conv1d
from .gdn import gdn_replay_fwd, naive_gdn_replay


def split_qkv(mixed_qkv, HV: int, V: int, K: int):
    """[T, 2 H K + HV V] -> views q, k: [T, H, K] and v: [T, HV, V] (no copies)."""
    T, conv_dim = mixed_qkv.shape
    H = (conv_dim - HV * V) // (2 * K)
    q, k, v = torch.split(mixed_qkv, [H * K, H * K, HV * V], dim=-1)
    return q.view(T, H, K), k.view(T, H, K), v.view(T, HV, V)


def replay_gdn_layer(
    mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cu_seqlens, slots, conv_states, ssm_states,
    state_only: bool = False, max_seqlen: int | None = None, beta_scale: float = 1.0, cu_seqlens_cpu=None,
):
    """Replay one GDN layer over a packed batch of tails, each from its slot's states; the new states replace them.

    mixed_qkv: [T, 2 H K + HV V] pre-conv projections (q | k | v); a, b: [T, HV] raw gate inputs;
    conv_weight: [conv_dim, width]; conv_bias: [conv_dim] or None (SiLU conv, as Qwen3.5 / Qwen3-Next);
    A_log, dt_bias: [HV];
    cu_seqlens: [N + 1] int tail boundaries; slots: [N] int distinct mamba slot of each tail;
    conv_states: [num_slots, conv_dim, width - 1] and ssm_states: [num_slots, HV, V, K], this layer's pools:
    tail i starts from the states in slot slots[i] (conv: the last width - 1 inputs before the tail, oldest first;
    recurrent: S), zeros after SGLang cleared it or a copied anchor state, and the slot then gets the tail's conv
    state (last width - 1 inputs of context + tail) and final recurrent state; no other slot is read or written.
    max_seqlen: longest tail, known to the planner; saves the Triton path a device sync (read when None).
    beta_scale: beta = beta_scale * sigmoid(b); 2 for OLMo-Hybrid's `linear_allow_neg_eigval`, 1 otherwise.
    cu_seqlens_cpu: cu_seqlens on the host, known to the planner; saves fla's chunk kernel a device sync.
    Returns o: [T, HV, V] in mixed_qkv's dtype (before the gated norm), or None when `state_only`.
    """
    args = (mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cu_seqlens, slots, conv_states, ssm_states)
    if mixed_qkv.is_cuda:
        return replay_gdn_layer_triton(*args, state_only=state_only, max_seqlen=max_seqlen, beta_scale=beta_scale,
                                       cu_seqlens_cpu=cu_seqlens_cpu)
    return replay_gdn_layer_torch(*args, state_only=state_only, beta_scale=beta_scale)


# The replay kernel walks a tail's chunks one after another, one program per (value block, head, tail); fla's chunk
# kernel splits a tail into chunk-parallel parts and a light sequential state pass. Measured on
# an H200 (../shared/notes/gpu-h200-2026-12-04.md, bfloat16, outputs and final states): ours 6.7x faster for one
# tail of 512 tokens and 1.7x at 2,048; fla 2x faster at 8,192 and 3.7x at 32,768; batches of short tails favour
# ours (2.7x at 64 x 64, even at 8 x 1,024). A batch whose longest tail is longer than this goes to fla's kernel.
CHUNK_KERNEL_FROM = 4096


def replay_gdn_layer_triton(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cu_seqlens, slots, conv_states,
                            ssm_states, state_only=False, max_seqlen=None, beta_scale=1.0, cu_seqlens_cpu=None):
    """`replay_gdn_layer` on the Triton kernels (on CPU only under TRITON_INTERPRET=1, as the tests run it); each
    kernel reads the slots' states itself. Long tails (`CHUNK_KERNEL_FROM`) take fla's chunk kernel."""
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # a device sync: the planner passes it
    y = replay_causal_conv1d(mixed_qkv, conv_weight, conv_bias, cu_seqlens, slots, conv_states, max_seqlen)
    q, k, v = split_qkv(y, *ssm_states.shape[1:])
    return gdn_replay(q, k, v, a, b, A_log, dt_bias, cu_seqlens, slots, ssm_states, max_seqlen,
                      state_only=state_only, beta_scale=beta_scale, cu_seqlens_cpu=cu_seqlens_cpu)


def gdn_replay(q, k, v, a, b, A_log, dt_bias, cu_seqlens, slots, ssm_states, max_seqlen: int, state_only=False,
               beta_scale=1.0, cu_seqlens_cpu=None):
    """A replay's delta rule on the GPU (`gdn_replay_fwd`'s arguments, and the longest tail): this package's kernel,
    or fla's chunk kernel when the longest tail is longer than `CHUNK_KERNEL_FROM`."""
    if max_seqlen > CHUNK_KERNEL_FROM:
        return gdn_replay_chunk_kernel(q, k, v, a, b, A_log, dt_bias, cu_seqlens, slots, ssm_states,
                                       state_only=state_only, beta_scale=beta_scale, cu_seqlens_cpu=cu_seqlens_cpu)
    return gdn_replay_fwd(q, k, v, a, b, A_log, dt_bias, cu_seqlens, slots, ssm_states, state_only=state_only,
                          beta_scale=beta_scale)


def gdn_replay_chunk_kernel(q, k, v, a, b, A_log, dt_bias, cu_seqlens, slots, ssm_states, state_only=False,
                            beta_scale=1.0, cu_seqlens_cpu=None):
    """`gdn_replay_fwd` (same arguments and result) on fla's chunk kernel (fla-core, pinned): the gates computed
    first in float32, each tail's state gathered from its slot (SGLang's value-major layout, `state_v_first`) and
    its final state written back there. With `cu_seqlens_cpu` (the planner's host copy) fla builds its chunk
    indices on the host; without it, it reads cu_seqlens back from the device once (GPU path review H)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    g, beta = cpu_gdn.gdn_gating(A_log, a, b, dt_bias, beta_scale=beta_scale)
    o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g, beta, initial_state=ssm_states[slots].float(),
                                      output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True,
                                      cu_seqlens=cu_seqlens.long(), cu_seqlens_cpu=cu_seqlens_cpu)
    ssm_states[slots] = final.to(ssm_states.dtype)
    return None if state_only else o[0]


def replay_gdn_layer_torch(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cu_seqlens, slots, conv_states,
                           ssm_states, state_only=False, beta_scale=1.0):
    """`replay_gdn_layer` on the torch ops of tailreplay_sglang.ops (the CPU path); same arguments."""
    # both ops read each tail's slot before writing it: the conv its left context (every tail has one, zeros or an
    # anchor's), chunk_gated_delta_rule its initial state, with the final state written back into the pool
    from_slot = torch.ones(len(slots), dtype=torch.bool)
    y = cpu_conv.causal_conv1d_fwd(mixed_qkv.T, conv_weight, conv_bias, conv_states, cu_seqlens, slots, from_slot,
                                   "silu")
    q, k, v = split_qkv(y.T, *ssm_states.shape[1:])
    o, _ = gdn_replay_torch(q, k, v, a, b, A_log, dt_bias, cu_seqlens, state_only, ssm_states, slots, beta_scale)
    return o


def gdn_replay_torch(q, k, v, a, b, A_log, dt_bias, cu_seqlens, state_only=False, initial_states=None,
                     initial_state_indices=None, beta_scale=1.0):
    """Chunked torch GDN replay (shapes as `gdn_replay_fwd`), each tail from an initial state.

    initial_states: None (every tail from zero), [N, HV, V, K] (tail i from initial_states[i]), or with
    initial_state_indices ([N] slots) the [num_slots, HV, V, K] pool (tail i from its slot). As in
    `chunk_gated_delta_rule`, the tensor read is updated in place with the final states.
    Returns (o [T, HV, V] in v's dtype or None when `state_only`, final states [N, HV, V, K] float32).
    """
    g, beta = cpu_gdn.gdn_gating(A_log, a, b, dt_bias, beta_scale=beta_scale)
    o, final = cpu_gdn.chunk_gated_delta_rule(q[None], k[None], v[None], g, beta, initial_states, cu_seqlens,
                                              initial_state_indices, use_qk_l2norm_in_kernel=True,
                                              state_only=state_only)
    return (None if o is None else o[0]), final


def naive_replay_gdn_layer(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cu_seqlens, HV, V, K,
                           conv_initial=None, ssm_initial=None, beta_scale=1.0):
    """Reference of `replay_gdn_layer` in the inputs' dtype (tests use float64).

    conv_initial: [N, conv_dim, width - 1] and ssm_initial: [N, HV, V, K], the states each tail starts from, as its
    slot holds them (None: zeros).
    Returns (o [T, HV, V], conv states [N, conv_dim, width - 1], final states [N, HV, V, K]).
    """
    y, conv_final = naive_replay_causal_conv1d(mixed_qkv, conv_weight, conv_bias, cu_seqlens, conv_initial)
    o, ssm_final = naive_gdn_replay(*split_qkv(y, HV, V, K), a, b, A_log, dt_bias, cu_seqlens,
                                    initial_states=ssm_initial, beta_scale=beta_scale)
    return o, conv_final, ssm_final
