"""Jet-Nemotron's delta rule on SGLang's CPU engine (`JetNemotronForCausalLM`).

JetBlock (`models/jet_nemotron.py`) runs its prefill and its decode through one Triton kernel, fla's
`fused_recurrent_gated_delta_rule_update` (`kernels/ops/attention/fla/fused_recurrent.py`), which has no CPU driver.
A `replace` row of `hooks.CPU_ENGINE` puts this torch body, with the kernel's arguments, at its defining module
(SGLang's hook registry rebinds the model module's imported name too). The math is the plugin's token-serial
`ops.gdn.recurrent_steps`, which updates in the kernel's order (S *= exp(g); v -= S k; v *= beta; S += v k^T;
o = S q). Token-serial, not chunked: a prefill split anywhere (chunked prefill, an anchor and its replay) then
computes what one call over the whole prompt does.
"""

import torch

from tailreplay_sglang.ops.gdn import _expand_key_heads, l2norm, recurrent_steps


def fused_recurrent_update(q, k, v, g, beta=None, scale=None, initial_state_source=None, initial_state_indices=None,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, disable_state_update=False,
                           disable_output_calculation=False, intermediate_states_buffer=None,
                           intermediate_state_indices=None, cache_steps=None, retrieve_parent_token=None):
    """The kernel's contract: q, k [B, T, H, K], v [B, T, HV, V], g and beta [B, T, HV] (value head i reads key head
    i // (HV // H)); B sequences of T tokens, or with `cu_seqlens` B = 1 and the sequences packed. Each sequence
    starts from its slot of `initial_state_source` ([slots, HV, V, K]) and its final state is written back in the
    pool's dtype; a slot < 0 starts from zero and is not written. Returns o [B, T, HV, V] in q's dtype, or, with
    `disable_output_calculation`, the kernel's placeholder (a [1, 1, 1, 1] tensor: the state is the point)."""
    if intermediate_states_buffer is not None or retrieve_parent_token is not None or disable_state_update:
        raise NotImplementedError("CPU fused_recurrent_gated_delta_rule_update: speculative verify (intermediate "
                                  "states, tree masks, no state update) is not ported")
    if initial_state_source is None:
        raise NotImplementedError("CPU fused_recurrent_gated_delta_rule_update: JetBlock always passes its pool")
    if beta is not None and beta.ndim == v.ndim:
        raise NotImplementedError("CPU fused_recurrent_gated_delta_rule_update: per-channel beta is not ported")
    batch, length, _, key_dim = k.shape
    value_heads = v.shape[2]
    if cu_seqlens is None:  # B sequences of T tokens: the same as one packed row with equal lengths
        cu_seqlens = torch.arange(0, batch * length + 1, length, device=q.device)
        q, k, v = (x.reshape(1, batch * length, *x.shape[2:]) for x in (q, k, v))
        g = g.reshape(1, batch * length, value_heads)
        beta = None if beta is None else beta.reshape(1, batch * length, value_heads)
    scale = key_dim ** -0.5 if scale is None else scale
    qf, kf = q[0].float(), k[0].float()
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    qf, kf = _expand_key_heads(qf, value_heads) * scale, _expand_key_heads(kf, value_heads)
    betaf = torch.ones_like(g[0], dtype=torch.float32) if beta is None else beta[0].float()
    o = recurrent_steps(qf, kf, v, g[0].float().unsqueeze(-1), betaf, initial_state_source, initial_state_indices,
                        cu_seqlens)
    if disable_output_calculation:
        return q.new_empty(1, 1, 1, 1)
    return o.reshape(batch, length, value_heads, v.shape[-1]).to(q.dtype)
