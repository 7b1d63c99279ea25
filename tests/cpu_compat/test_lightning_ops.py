"""Lightning attention's torch ops (Ling-2.5): the plugin's chunked scan (`tailreplay_sglang.ops.lightning`, which the
replay's interval anchors use) and the CPU port's `seg_la_fwd` body (`sglang_cpu_compat.lightning`) against the
float64 token-by-token recurrence over random shapes, and the port's norms against their formulas."""

import pytest
import torch

from helpers import rel_err
from sglang_cpu_compat import fused, lightning as cpu_lightning, triton_branches
from tailreplay_sglang.ops import lightning

TOL = 1e-5


def _slopes(heads: int) -> torch.Tensor:
    """Memories from about 1 token to about 10^4: the range Ling-2.5's layers span."""
    return torch.logspace(0, -4, heads)


@pytest.mark.parametrize("T,H,D,ends", [(1, 1, 8, ()), (63, 2, 16, (5,)), (64, 3, 8, (0, 64)),
                                        (65, 2, 16, (1, 64, 65)), (200, 4, 32, (17, 128, 129, 199))])
def test_scan_matches_the_float64_recurrence(T, H, D, ends):
    torch.manual_seed(T)
    q, k, v = (torch.randn(T, H, D) for _ in range(3))
    state, slope = torch.randn(H, D, D), _slopes(H)
    o, final, states = lightning.scan(q, k, v, slope, state, 0.3, ends)
    ref_o, ref_states = lightning.naive_recurrence(q, k, v, slope, state, 0.3)
    assert rel_err(o, ref_o) < TOL and rel_err(final, ref_states[-1]) < TOL
    for end, got in zip(ends, states, strict=True):
        assert rel_err(got, state.double() if end == 0 else ref_states[end - 1]) < TOL
    _, state_only_final, state_only = lightning.scan(None, k, v, slope, state, 0.3, ends, state_only=True)
    assert torch.equal(state_only_final, final) and all(torch.equal(a, b) for a, b in zip(state_only, states))


def _meta(lengths, slots, scales):
    from sglang.kernels.ops.attention.linear.seg_la import SegLaMeta

    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return SegLaMeta(batch_size=len(lengths), max_q_length=None, q_offsets=cu, s_offsets=torch.tensor(slots),
                     q_lengths=cu.diff(), s_scales=torch.tensor(scales))


def test_seg_la_body_runs_each_sequence_from_its_slot_as_the_kernel_does():
    """A packed prefill: a sequence with s_scales 1 continues its slot's state, one with 0 starts from zero, slot -1
    is skipped (its output zero, no slot written); `track_lens` stores a sequence's state after that many tokens
    (a multiple of seg_la's 32-token block) into its track slot."""
    torch.manual_seed(0)
    H, D, lengths = 2, 16, [70, 33, 5]
    slots, scales = [3, 1, -1], [1, 0, 1]
    T = sum(lengths)
    q, k, v = (torch.randn(T, H, D) for _ in range(3))
    pool = torch.randn(6, H, D, D)
    before = pool.clone()
    slope = _slopes(H).reshape(H, 1, 1)
    o = cpu_lightning.seg_la_fwd(q, k, v, pool, slope, _meta(lengths, slots, scales),
                                 track_lens=torch.tensor([64, 0, 0]), track_state_indices=torch.tensor([5, -1, -1]),
                                 softmax_scale=0.25)
    first, second = slice(0, 70), slice(70, 103)
    ref_o, ref_states = lightning.naive_recurrence(q[first], k[first], v[first], slope, before[3], 0.25)
    assert rel_err(o[first], ref_o) < TOL and rel_err(pool[3], ref_states[-1]) < TOL
    assert rel_err(pool[5], ref_states[63]) < TOL
    ref_o, ref_states = lightning.naive_recurrence(q[second], k[second], v[second], slope,
                                                   torch.zeros(H, D, D), 0.25)
    assert rel_err(o[second], ref_o) < TOL and rel_err(pool[1], ref_states[-1]) < TOL
    assert torch.equal(o[103:], torch.zeros_like(o[103:]))
    assert all(torch.equal(pool[i], before[i]) for i in (0, 2, 4))


def test_seg_la_body_one_token_per_sequence_is_the_decode_kernel():
    """Every sequence one token (the decode kernel): the slot is read whatever s_scales says, as seg_la_d_kernel
    does, and the step continues a prefill exactly."""
    torch.manual_seed(1)
    H, D = 3, 8
    q, k, v = (torch.randn(41, H, D) for _ in range(3))
    slope = _slopes(H).reshape(H, 1, 1)
    pool = torch.zeros(2, H, D, D)
    prefill = cpu_lightning.seg_la_fwd(q[:40], k[:40], v[:40], pool, slope, _meta([40], [1], [0]))
    step = cpu_lightning.seg_la_fwd(q[40:], k[40:], v[40:], pool, slope, _meta([1], [1], [0]))
    ref_o, ref_states = lightning.naive_recurrence(q, k, v, slope, torch.zeros(H, D, D), D ** -0.5)
    assert rel_err(torch.cat([prefill, step]), ref_o) < TOL and rel_err(pool[1], ref_states[-1]) < TOL


def test_seg_la_body_refuses_speculative_verify():
    q = torch.randn(4, 1, 8)
    with pytest.raises(NotImplementedError, match="speculative"):
        cpu_lightning.seg_la_fwd(q, q, q, torch.zeros(2, 1, 8, 8), torch.ones(1, 1, 1), _meta([2, 2], [0, 1], [1, 1]),
                                 caches=torch.zeros(2, 2, 1, 8, 8), cache_indices=torch.arange(2))


def test_grouped_sigmoid_gated_rmsnorm_and_layernorm_fn_match_their_formulas():
    """Ling-2.5's output norm (RMSNorm over groups of channels, times weight, times sigmoid of the gate) and its
    per-head q/k norm (fla's `layernorm_fn` in its plain RMSNorm form)."""
    torch.manual_seed(2)
    x, gate, weight = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    groups = x.view(5, 2, 32).double()
    normed = (groups / groups.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()).view(5, 64) * weight.double()
    expected = normed * gate.double().sigmoid()
    assert rel_err(fused.gated_rmsnorm(x, weight, gate, 1e-6, "sigmoid", group_size=32), expected) < TOL
    assert rel_err(fused.gated_rmsnorm(x, weight, None, 1e-6, group_size=32), normed) < TOL
    heads = torch.randn(7, 4, 16)
    per_head = heads.double() / heads.double().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * weight[:16].double()
    assert rel_err(triton_branches.layernorm_fn(heads, weight[:16], None, eps=1e-6, is_rms_norm=True), per_head) < TOL

