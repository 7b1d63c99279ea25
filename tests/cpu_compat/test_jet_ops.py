"""Jet-Nemotron's delta rule on the CPU port (`sglang_cpu_compat.jet.fused_recurrent_update`, the torch body of fla's
`fused_recurrent_gated_delta_rule_update`) against a float64 token-by-token statement of the Triton kernel
(`fused_recurrent.py`: l2-normed q and k, q scaled by K^-1/2, then S *= exp(g); v -= S k; v *= beta; S += v k^T;
o = S q), over random shapes, packed sequences and slots of -1."""

import pytest
import torch

from helpers import rel_err
from sglang_cpu_compat.jet import fused_recurrent_update

TOL = 1e-5


def _float64_kernel(q, k, v, g, beta, state):
    """One sequence, float64: q, k [T, H, K], v [T, HV, V], g, beta [T, HV], state [HV, V, K] -> (o [T, HV, V],
    final state)."""
    q, k, v, g, beta, S = (x.double() for x in (q, k, v, g, beta, state))
    repeat = v.shape[1] // q.shape[1]
    outs = []
    for t in range(q.shape[0]):
        qt = (q[t] / (q[t].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(repeat, 0)
        kt = (k[t] / (k[t].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(repeat, 0)
        qt = qt * q.shape[-1] ** -0.5
        S = S * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, kt))
        S = S + u[:, :, None] * kt[:, None, :]
        outs.append(torch.einsum("hvk,hk->hv", S, qt))
    return torch.stack(outs) if outs else v.new_zeros(0, *v.shape[1:]), S


def _inputs(seed, lengths, H, HV, K, V):
    torch.manual_seed(seed)
    T = sum(lengths)
    q, k = torch.randn(1, T, H, K), torch.randn(1, T, H, K)
    v = torch.randn(1, T, HV, V)
    g = -torch.rand(1, T, HV) * torch.logspace(-3, 0, HV)  # memories from about 1 token to about 1000
    beta = torch.rand(1, T, HV)
    return q, k, v, g, beta


@pytest.mark.parametrize("seed,lengths,slots,H,HV,K,V", [
    (0, [1], [2], 1, 1, 8, 8),
    (1, [37, 20], [3, 1], 2, 2, 32, 64),
    (2, [5, 70, 1, 12], [0, -1, 4, 2], 2, 4, 16, 32),  # grouped value heads; slot -1 starts from zero, kept out
    (3, [1, 1, 1], [-1, 5, 3], 4, 4, 16, 16),  # a decode batch: one token per sequence
    (4, [130, 0, 9], [1, 2, -1], 3, 3, 16, 48),  # an empty sequence leaves its slot's state as it was
])
def test_port_matches_the_float64_kernel(seed, lengths, slots, H, HV, K, V):
    q, k, v, g, beta = _inputs(seed, lengths, H, HV, K, V)
    pool = torch.randn(6, HV, V, K) * 0.3
    before = pool.clone()
    cu = torch.tensor([0] + lengths).cumsum(0)
    o = fused_recurrent_update(q, k, v, g, beta, initial_state_source=pool, initial_state_indices=torch.tensor(slots),
                               cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert o.shape == v.shape and o.dtype == q.dtype
    for (start, end), slot in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), slots):
        entering = before[slot] if slot >= 0 else torch.zeros_like(before[0])
        ref_o, ref_state = _float64_kernel(q[0, start:end], k[0, start:end], v[0, start:end], g[0, start:end],
                                           beta[0, start:end], entering)
        if end > start:
            assert rel_err(o[0, start:end], ref_o) < TOL
        if slot >= 0:
            assert rel_err(pool[slot], ref_state) < TOL
    untouched = sorted(set(range(6)) - {s for s in slots if s >= 0})
    assert torch.equal(pool[untouched], before[untouched])


def test_state_only_calls_write_the_same_states_and_return_the_kernels_placeholder():
    """`disable_output_calculation` (the kernel's state-only mode): the same slots written, no output computed."""
    q, k, v, g, beta = _inputs(5, [40, 17], 2, 2, 16, 32)
    pool = torch.randn(4, 2, 32, 16)
    state_only = pool.clone()
    args = dict(initial_state_indices=torch.tensor([2, 0]), cu_seqlens=torch.tensor([0, 40, 57]),
                use_qk_l2norm_in_kernel=True)
    fused_recurrent_update(q, k, v, g, beta, initial_state_source=pool, **args)
    placeholder = fused_recurrent_update(q, k, v, g, beta, initial_state_source=state_only,
                                         disable_output_calculation=True, **args)
    assert placeholder.shape == (1, 1, 1, 1)
    assert torch.equal(state_only, pool)


def test_unpacked_batches_are_sequences_of_equal_length():
    """Without cu_seqlens the kernel reads q [B, T, ...] as B sequences of T tokens: the same as packing them."""
    q, k, v, g, beta = _inputs(6, [24, 24, 24], 2, 2, 16, 16)
    packed = torch.randn(5, 2, 16, 16)
    batched = packed.clone()
    slots = torch.tensor([4, -1, 1])
    o = fused_recurrent_update(q, k, v, g, beta, initial_state_source=packed, initial_state_indices=slots,
                               cu_seqlens=torch.tensor([0, 24, 48, 72]), use_qk_l2norm_in_kernel=True)
    o_batched = fused_recurrent_update(*(x.view(3, 24, *x.shape[2:]) for x in (q, k, v, g, beta)),
                                       initial_state_source=batched, initial_state_indices=slots,
                                       use_qk_l2norm_in_kernel=True)
    assert o_batched.shape == (3, 24, 2, 16)
    assert torch.equal(o_batched.reshape(o.shape), o) and torch.equal(batched, packed)


def test_speculative_verify_is_refused():
    q, k, v, g, beta = _inputs(7, [4], 1, 1, 8, 8)
    with pytest.raises(NotImplementedError, match="speculative"):
        fused_recurrent_update(q, k, v, g, beta, initial_state_source=torch.zeros(2, 1, 8, 8),
                               initial_state_indices=torch.tensor([0]), cu_seqlens=torch.tensor([0, 4]),
                               intermediate_states_buffer=torch.zeros(2, 4, 1, 8, 8))
