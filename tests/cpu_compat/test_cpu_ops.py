"""The CPU port's ops (sglang_cpu_compat) and the plugin's torch ops they build on (tailreplay_sglang.ops) against
float64 token-by-token references, float32 relative error < 1e-5."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err
from sglang_cpu_compat import fused, mamba2
from sglang_cpu_compat import kda as cpu_kda
from sglang_cpu_compat.ops import kda
from tailreplay_sglang.ops import conv, gdn, naive

TOL = 1e-5

# (lengths of the packed sequences, key heads H, value heads HV, K, V)
GDN_CASES = [
    pytest.param([1], 1, 1, 16, 16, id="T1-H1"),
    pytest.param([63], 2, 2, 16, 32, id="T63-H2"),
    pytest.param([65, 3], 2, 4, 16, 24, id="varlen-T65,3-HV2H"),
    pytest.param([1, 130, 64, 7], 2, 4, 32, 32, id="varlen4-HV2H"),
    pytest.param([200], 4, 8, 8, 16, id="T200-H4-HV8"),
]


def _gdn_inputs(lengths, H, HV, K, V, slots=12):
    T = sum(lengths)
    q, k = torch.randn(1, T, H, K), torch.randn(1, T, H, K)
    v = torch.randn(1, T, HV, V)
    g = -torch.rand(1, T, HV) * 0.3  # decays in (0.74, 1]: states keep memory across chunks
    beta = torch.rand(1, T, HV)
    pool = torch.randn(slots, HV, V, K) * 0.5  # nonzero initial states
    idx = torch.randperm(slots)[: len(lengths)]
    cu = torch.tensor([0] + lengths).cumsum(0)
    return q, k, v, g, beta, pool, idx, cu


def _reference(q, k, v, g, beta, state, s, e, l2norm=True):
    G = v.shape[2] // q.shape[2]
    q64, k64 = (x[0, s:e].double().repeat_interleave(G, dim=1) for x in (q, k))
    return naive.naive_recurrent_gated_delta_rule(
        q64, k64, v[0, s:e].double(), g[0, s:e].double(), beta[0, s:e].double(), state.double(), use_qk_l2norm=l2norm
    )


@pytest.mark.parametrize("lengths,H,HV,K,V", GDN_CASES)
def test_chunk_gated_delta_rule_matches_recurrence(lengths, H, HV, K, V):
    q, k, v, g, beta, pool, idx, cu = _gdn_inputs(lengths, H, HV, K, V)
    pool_before = pool.clone()
    o, final = gdn.chunk_gated_delta_rule(q, k, v, g, beta, pool, cu, idx, use_qk_l2norm_in_kernel=True)
    assert o.shape == v.shape
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref_o, ref_state = _reference(q, k, v, g, beta, pool_before[idx[i]], s, e)
        assert rel_err(o[0, s:e], ref_o) < TOL
        assert rel_err(pool[idx[i]], ref_state) < TOL  # written in place at the slot
        assert rel_err(final[i], ref_state) < TOL
    untouched = torch.ones(len(pool), dtype=torch.bool)
    untouched[idx] = False
    assert torch.equal(pool[untouched], pool_before[untouched])


def test_chunk_gated_delta_rule_pad_slot_starts_from_zero_and_writes_nothing():
    q, k, v, g, beta, pool, _, cu = _gdn_inputs([70], 2, 4, 16, 16)
    pool_before = pool.clone()
    o, _ = gdn.chunk_gated_delta_rule(q, k, v, g, beta, pool, cu, torch.tensor([-1]), use_qk_l2norm_in_kernel=True)
    ref_o, _ = _reference(q, k, v, g, beta, torch.zeros_like(pool[0]), 0, 70)
    assert rel_err(o[0], ref_o) < TOL
    assert torch.equal(pool, pool_before)


def test_decode_update_matches_recurrence_and_continues_prefill():
    """Prefill 50 tokens then decode 3 single-token steps == the recurrence over all 53 tokens."""
    H, HV, K, V, B = 2, 4, 16, 16, 3
    A_log, dt_bias = torch.randn(HV) * 0.5, torch.randn(HV)
    T = 53
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, HV, V)
    a, b = torch.randn(B, T, HV), torch.randn(B, T, HV)
    pool = torch.zeros(8, HV, V, K)
    slots = torch.tensor([5, 2, 6])
    for i in range(B):  # prefill each sequence through the chunked op
        g, beta = gdn.gdn_gating(A_log, a[i, :50], b[i, :50], dt_bias)
        gdn.chunk_gated_delta_rule(q[i:i + 1, :50], k[i:i + 1, :50], v[i:i + 1, :50], g, beta, pool,
                                   torch.tensor([0, 50]), slots[i:i + 1], use_qk_l2norm_in_kernel=True)
    outs = []
    for t in range(50, T):  # batched decode: one token per sequence
        outs.append(gdn.recurrent_gated_delta_rule_update(
            A_log, dt_bias, q[:, t].unsqueeze(0), k[:, t].unsqueeze(0), v[:, t].unsqueeze(0), a[:, t], b[:, t],
            pool, slots, torch.arange(B + 1), use_qk_l2norm_in_kernel=True))
    for i in range(B):
        g, beta = gdn.gdn_gating(A_log.double(), a[i].double(), b[i].double(), dt_bias.double())
        ref_o, ref_state = _reference(q[i:i + 1], k[i:i + 1], v[i:i + 1], g, beta, torch.zeros(HV, V, K), 0, T)
        assert rel_err(torch.stack([o[0, i] for o in outs]), ref_o[50:]) < TOL
        assert rel_err(pool[slots[i]], ref_state) < TOL


def test_chunk_gated_delta_rule_with_beta_up_to_2_matches_recurrence():
    """OLMo-Hybrid's negative eigenvalues: beta in (0, 2), so I - beta k k^T flips the state along k."""
    q, k, v, g, beta, pool, idx, cu = _gdn_inputs([65, 130], 2, 4, 16, 24)
    beta = beta * 2
    assert beta.max() > 1.5  # the range the Qwen models never reach
    pool_before = pool.clone()
    o, _ = gdn.chunk_gated_delta_rule(q, k, v, g, beta, pool, cu, idx, use_qk_l2norm_in_kernel=True)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref_o, ref_state = _reference(q, k, v, g, beta, pool_before[idx[i]], s, e)
        assert rel_err(o[0, s:e], ref_o) < TOL
        assert rel_err(pool[idx[i]], ref_state) < TOL


def test_decode_update_with_beta_scale_2_continues_prefill():
    """Prefill 40 tokens with beta = 2 sigmoid(b), then decode 3 tokens with beta_scale=2 == the recurrence."""
    H, HV, K, V, T, P = 2, 4, 16, 16, 43, 40
    A_log, dt_bias = torch.randn(HV) * 0.5, torch.randn(HV)
    q, k, v = torch.randn(1, T, H, K), torch.randn(1, T, H, K), torch.randn(1, T, HV, V)
    a, b = torch.randn(T, HV), torch.randn(T, HV) + 2  # sigmoid(b) mostly above 1/2: beta mostly above 1
    pool, slot = torch.zeros(4, HV, V, K), torch.tensor([3])
    g, beta = gdn.gdn_gating(A_log, a[:P], b[:P], dt_bias, beta_scale=2.0)
    gdn.chunk_gated_delta_rule(q[:, :P], k[:, :P], v[:, :P], g, beta, pool, torch.tensor([0, P]), slot,
                               use_qk_l2norm_in_kernel=True)
    outs = [gdn.recurrent_gated_delta_rule_update(A_log, dt_bias, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                                  a[t:t + 1], b[t:t + 1], pool, slot, torch.tensor([0, 1]),
                                                  use_qk_l2norm_in_kernel=True, beta_scale=2.0)[0, 0]
            for t in range(P, T)]
    g, beta = gdn.gdn_gating(A_log.double(), a.double(), b.double(), dt_bias.double(), beta_scale=2.0)
    ref_o, ref_state = _reference(q, k, v, g, beta, torch.zeros(HV, V, K), 0, T)
    assert rel_err(torch.stack(outs), ref_o[P:]) < TOL
    assert rel_err(pool[3], ref_state) < TOL


def test_gating_formula():
    A_log, dt_bias, a, b = torch.randn(6), torch.randn(6), torch.randn(9, 6) * 10, torch.randn(9, 6)
    g, beta = gdn.gdn_gating(A_log, a, b, dt_bias)
    x = a.double() + dt_bias.double()
    softplus = torch.where(x <= 20, torch.log1p(torch.exp(x)), x)
    assert g.shape == beta.shape == (1, 9, 6) and g.dtype == beta.dtype == torch.float32
    assert rel_err(g[0], -A_log.double().exp() * softplus) < TOL
    assert rel_err(beta[0], torch.sigmoid(b.double())) < TOL
    _, beta2 = gdn.gdn_gating(A_log, a, b, dt_bias, beta_scale=2.0)
    assert rel_err(beta2[0], 2 * torch.sigmoid(b.double())) < TOL


CONV_CASES = [
    pytest.param([1], 4, id="T1<width"),
    pytest.param([2, 3, 1], 4, id="all-shorter-than-width"),
    pytest.param([17, 2, 40], 4, id="varlen"),
    pytest.param([9], 2, id="width2"),
]


@pytest.mark.parametrize("lengths,width", CONV_CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_causal_conv1d_fwd_matches_reference(lengths, width, with_bias):
    dim, slots = 12, 8
    x = torch.randn(dim, sum(lengths))
    weight, bias = torch.randn(dim, width), (torch.randn(dim) if with_bias else None)
    states = torch.randn(slots, dim, width - 1)
    states_before = states.clone()
    idx = torch.randperm(slots)[: len(lengths)]
    has_init = torch.tensor([i % 2 == 0 for i in range(len(lengths))])
    cu = torch.tensor([0] + lengths).cumsum(0)
    y = conv.causal_conv1d_fwd(x, weight, bias, states, cu, idx, has_init, "silu")
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        init = states_before[idx[i]].double() if has_init[i] else None
        ref_y, ref_state = naive.naive_causal_conv1d(x[:, s:e].double(), weight.double(),
                                                     None if bias is None else bias.double(), init)
        assert rel_err(y[:, s:e], ref_y) < TOL
        assert rel_err(states[idx[i]], ref_state) < TOL


def test_causal_conv1d_update_matches_reference():
    dim, width, B = 10, 4, 3
    states = torch.randn(6, dim, width - 1)
    before = states.clone()
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    x = torch.randn(B, dim)
    slots = torch.tensor([4, -1, 1])  # -1: padded row, must not touch any slot
    y = conv.causal_conv1d_update(x, states, weight, bias, "silu", slots)
    for b, slot in enumerate(slots.tolist()):
        init = before[slot].double() if slot >= 0 else None
        ref_y, ref_state = naive.naive_causal_conv1d(x[b, :, None].double(), weight.double(), bias.double(), init)
        assert rel_err(y[b], ref_y[:, 0]) < TOL
        if slot >= 0:
            assert rel_err(states[slot], ref_state) < TOL
    assert torch.equal(states[[0, 2, 3, 5]], before[[0, 2, 3, 5]])


def _gemma_ref(x, w, eps):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.double())


def test_fused_qk_gemma_rmsnorm():
    T, nh, nkv, hd = 5, 4, 2, 16
    q, k = torch.randn(T, nh * hd), torch.randn(T, nkv * hd)
    qw, kw = torch.randn(hd), torch.randn(hd)
    q_out, k_out = fused.fused_qk_gemma_rmsnorm(q, k, qw, kw, 1e-6, hd)
    assert q_out.shape == (T * nh, hd) and k_out.shape == (T * nkv, hd)
    assert rel_err(q_out, _gemma_ref(q.view(-1, hd), qw, 1e-6)) < TOL
    assert rel_err(k_out, _gemma_ref(k.view(-1, hd), kw, 1e-6)) < TOL


def test_fused_qk_gemma_rmsnorm_with_gate_deinterleaves_per_head():
    T, nh, nkv, hd = 3, 4, 2, 8
    q = torch.randn(T, nh, hd)
    gate = torch.randn(T, nh, hd)
    q_gate = torch.stack([q, gate], dim=2).reshape(T, nh * 2 * hd)
    k, qw, kw = torch.randn(T, nkv * hd), torch.randn(hd), torch.randn(hd)
    q_out, k_out, gate_out = fused.fused_qk_gemma_rmsnorm_with_gate(q_gate, k, qw, kw, 1e-6, hd, nh)
    assert torch.equal(gate_out, gate.reshape(-1, hd))
    assert rel_err(q_out, _gemma_ref(q.reshape(-1, hd), qw, 1e-6)) < TOL
    assert rel_err(k_out, _gemma_ref(k.view(-1, hd), kw, 1e-6)) < TOL


def test_qkvzba_split_contiguous():
    T, H, HV, dk, dv = 4, 2, 4, 8, 6
    q, k, v, z = torch.randn(T, H * dk), torch.randn(T, H * dk), torch.randn(T, HV * dv), torch.randn(T, HV * dv)
    b, a = torch.randn(T, HV), torch.randn(T, HV)
    mixed_qkv, z_out, b_out, a_out = fused.qkvzba_split_contiguous(
        torch.cat([q, k, v, z], -1), torch.cat([b, a], -1), H, HV, dk, dv)
    assert torch.equal(mixed_qkv, torch.cat([q, k, v], -1))
    assert torch.equal(z_out, z.view(T, HV, dv)) and torch.equal(b_out, b) and torch.equal(a_out, a)


def test_sigmoid_mul_gated_rmsnorm_and_shared_expert_gate():
    x, gate = torch.randn(7, 16), torch.randn(7, 16)
    y = x.clone()
    fused.fused_sigmoid_mul_(y, gate)
    assert rel_err(y, x.double() * torch.sigmoid(gate.double())) < TOL

    w = torch.randn(16)
    xd = x.double()
    ref = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double() * F.silu(gate.double())
    assert rel_err(fused.gated_rmsnorm(x, w, gate, 1e-6, "silu"), ref) < TOL

    hidden, gate_w, shared, final = torch.randn(5, 16), torch.randn(16), torch.randn(5, 16), torch.randn(5, 16)
    expected = final.double() + torch.sigmoid(hidden.double() @ gate_w.double())[:, None] * shared.double()
    fused.gate_sigmoid_mul_add_(hidden, gate_w, shared, final)
    assert rel_err(final, expected) < TOL


SHIM_CHECK = """
import sys, torch
import sgl_kernel
from sgl_kernel.mamba import causal_conv1d_fn_cpu, causal_conv1d_update_cpu, chunk_gated_delta_rule_cpu
assert sgl_kernel.__tailreplay_fallback__
ops = torch.ops.sgl_kernel
for name in ["fused_gdn_gating_cpu", "fused_sigmoid_gating_delta_rule_update_cpu", "fused_sigmoid_mul_cpu",
             "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu",
             "fused_qkvzba_split_reshape_cat_contiguous_cpu"]:
    getattr(ops, name)
pool = torch.zeros(4, 2, 8, 8)
o = ops.fused_sigmoid_gating_delta_rule_update_cpu(
    A_log=torch.zeros(2), dt_bias=torch.zeros(2), q=torch.randn(1, 2, 1, 8), k=torch.randn(1, 2, 1, 8),
    v=torch.randn(1, 2, 2, 8), a=torch.randn(2, 2), b=torch.randn(2, 2), initial_state_source=pool,
    initial_state_indices=torch.tensor([1, 3]), cu_seqlens=torch.tensor([0, 1, 2]), use_qk_l2norm_in_kernel=True,
    softplus_beta=1.0, softplus_threshold=20.0)
assert o.shape == (1, 2, 2, 8) and pool[1].abs().sum() > 0 and pool[0].abs().sum() == 0
conv_states, weights = torch.zeros(3, 4, 3), torch.randn(4, 4)
out = causal_conv1d_update_cpu(torch.randn(2, 4), conv_states, weights, None, "silu",
                               conv_state_indices=torch.tensor([0, 2]), intermediate_conv_window=None)
assert out.shape == (2, 4) and conv_states[2].abs().sum() > 0 and conv_states[1].abs().sum() == 0
# speculative decoding's target verify: per-step windows and states go to the scratch buffers (ops.spec_verify)
windows = torch.zeros(3, 3, 4, 3)
causal_conv1d_update_cpu(torch.randn(2, 4, 3), conv_states, weights, None, "silu",
                         conv_state_indices=torch.tensor([0, 2]), intermediate_conv_window=windows,
                         intermediate_state_indices=torch.tensor([1, 2]))
assert windows[1:].abs().sum(dim=(2, 3)).min() > 0 and windows[0].abs().sum() == 0
try:  # a draft tree without its windows would commit wrong conv states: refused, not dropped
    causal_conv1d_update_cpu(torch.randn(1, 4, 3), conv_states, weights, None, "silu",
                             conv_state_indices=torch.tensor([0]), retrieve_next_token=torch.tensor([[1, 2, -1]]))
except NotImplementedError as e:
    assert "intermediate_conv_window" in str(e)
else:
    raise AssertionError("the draft tree's conv windows were dropped")
steps, before = torch.zeros(2, 2, 2, 8, 8), pool.clone()
ops.fused_sigmoid_gating_delta_rule_update_cpu(
    A_log=torch.zeros(2), dt_bias=torch.zeros(2), q=torch.randn(1, 2, 1, 8), k=torch.randn(1, 2, 1, 8),
    v=torch.randn(1, 2, 2, 8), a=torch.randn(2, 2), b=torch.randn(2, 2), initial_state_source=pool,
    initial_state_indices=torch.tensor([1]), cu_seqlens=torch.tensor([0, 2]), use_qk_l2norm_in_kernel=True,
    disable_state_update=True, intermediate_states_buffer=steps, intermediate_state_indices=torch.tensor([1]),
    cache_steps=2)
assert torch.equal(pool, before) and steps[1].abs().sum(dim=(1, 2, 3)).min() > 0 and steps[0].abs().sum() == 0
try:
    sgl_kernel.merge_state_v2()
except NotImplementedError as e:
    assert "merge_state_v2" in str(e)
else:
    raise AssertionError("stub did not raise")
import torchvision
from PIL import Image
from torchvision.transforms.v2 import functional as TF
assert not getattr(torchvision, "__tailreplay_fallback__", False), "the real torchvision, not the stub"
image = TF.pil_to_tensor(Image.new("RGB", (32, 24), (200, 10, 10)))  # what image preprocessing runs
assert TF.resize(image, [12, 16]).shape == (3, 12, 16) and int(image[0, 0, 0]) == 200
try:
    torchvision.ops.nms(torch.rand(3, 4), torch.rand(3), 0.5)  # its CUDA-built C++ ops stay unloaded
except RuntimeError as e:
    assert "C++ ops" in str(e)
else:
    raise AssertionError("nms ran without torchvision's C++ ops")
print("ok")
"""


def test_sgl_kernel_fallback_serves_the_cpu_ops_in_a_fresh_interpreter():
    """The .pth-installed finder gives `import sgl_kernel` our ops in any new process (SGLang's scheduler too)."""
    out = subprocess.run([sys.executable, "-c", SHIM_CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


def test_cpu_gated_norm_replacement_matches_formula():
    """The replacement forward of SGLang's gated RMSNorm module computes norm(x) * w * silu(z)."""
    from types import SimpleNamespace

    from sglang_cpu_compat.triton_branches import rmsnorm_gated_forward

    module = SimpleNamespace(weight=torch.randn(16), eps=1e-6, activation="swish", group_size=None,
                             norm_before_gate=True)
    x, z = torch.randn(5, 16), torch.randn(5, 16)
    xd = x.double()
    ref = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * module.weight.double() * F.silu(z.double())
    assert rel_err(rmsnorm_gated_forward(module, x, z), ref) < TOL


# ---- per-chunk states (h): what SGLang's extra_buffer strategy tracks prefill states from ----

def test_chunk_states_are_the_states_entering_each_64_token_chunk():
    """h[offset_i + j] (offset_i = chunks of the sequences before i) is the state of sequence i after 64 j of its
    tokens, as fla's chunk kernel returns it."""
    lengths = [200, 64, 1, 130]
    q, k, v, g, beta, pool, idx, cu = _gdn_inputs(lengths, 2, 4, 16, 16, slots=16)
    pool_before, plain = pool.clone(), pool.clone()
    o_plain, final_plain = gdn.chunk_gated_delta_rule(q, k, v, g, beta, plain, cu, idx, use_qk_l2norm_in_kernel=True)
    o, final, h = gdn.chunk_gated_delta_rule(q, k, v, g, beta, pool, cu, idx, use_qk_l2norm_in_kernel=True,
                                             chunk_states=True)
    assert h.shape == (1, sum(-(-n // 64) for n in lengths), 4, 16, 16)
    assert rel_err(o, o_plain) < TOL and rel_err(final, final_plain) < TOL
    row = 0
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for start in range(0, e - s, 64):
            ref = pool_before[idx[i]].double() if start == 0 else \
                _reference(q, k, v, g, beta, pool_before[idx[i]], s, s + start)[1]
            assert rel_err(h[0, row], ref) < TOL, (i, start)
            row += 1


def test_track_copy_moves_tracked_rows_states_into_their_track_slots():
    """The torch body of SGLang's Triton track kernel: rows with the mask set copy conv and SSM states from their
    live slot to their track slot, in every layer; other slots are untouched."""
    from sglang_cpu_compat import extra_buffer

    conv_pool, ssm_pool = torch.randn(3, 10, 6, 3), torch.randn(3, 10, 2, 4, 4)
    conv_before, ssm_before = conv_pool.clone(), ssm_pool.clone()
    live, track, mask = torch.tensor([1, 4, 7]), torch.tensor([2, 5, 8]), torch.tensor([True, False, True])
    extra_buffer.track_states_all_layers(conv_pool, ssm_pool, live, mask, track, 3)
    conv_ref, ssm_ref = conv_before.clone(), ssm_before.clone()
    conv_ref[:, [2, 8]], ssm_ref[:, [2, 8]] = conv_before[:, [1, 7]], ssm_before[:, [1, 7]]
    assert torch.equal(conv_pool, conv_ref) and torch.equal(ssm_pool, ssm_ref)
    one_conv, one_ssm = conv_before[0].clone(), ssm_before[0].clone()
    extra_buffer.track_states(one_conv, one_ssm, live, mask, track, 3)
    assert torch.equal(one_conv, conv_ref[0]) and torch.equal(one_ssm, ssm_ref[0])


# ---- interval anchors: states at planned offsets, from the prefill's inputs and per-chunk states ----

def test_interval_anchor_states_are_the_states_after_each_offset():
    """The plan's anchors (offsets 0, 64, 128 of a 200-token sequence; 64 of a 150-token one, packed after a third
    sequence with none) get the conv state the conv op leaves after `offset` tokens and the SSM state of the float64
    recurrence after them; nothing else changes, and every written slot is marked."""
    from tailreplay_sglang.cache.anchors import IntervalAnchors

    lengths, dim, width = [200, 30, 150], 12, 4
    q, k, v, g, beta, pool, idx, cu = _gdn_inputs(lengths, 2, 4, 16, 16, slots=16)
    spare = [i for i in range(16) if i not in idx.tolist()]
    anchors = IntervalAnchors(64)
    anchors.by_slot = {int(idx[0]): [(0, spare[0]), (64, spare[1]), (128, spare[2])], int(idx[2]): [(64, spare[3])]}
    x, weight = torch.randn(dim, sum(lengths)), torch.randn(dim, width)
    conv_pool, initial = torch.randn(16, dim, width - 1), torch.tensor([True, False, True])
    conv_before, pool_before = conv_pool.clone(), pool.clone()

    anchors.write_conv_states(x, conv_pool, idx, cu, initial)
    conv.causal_conv1d_fwd(x, weight, None, conv_pool, cu, idx, initial, "silu")
    _, _, h = gdn.chunk_gated_delta_rule(q, k, v, g, beta, pool, cu, idx, use_qk_l2norm_in_kernel=True,
                                         chunk_states=True)
    anchors.write_ssm_states(h, pool, idx, cu)

    for i, cuts in ((0, anchors.by_slot[int(idx[0])]), (2, anchors.by_slot[int(idx[2])])):
        s = int(cu[i])
        for offset, dst in cuts:
            alone = conv_before.clone()  # the conv run over the first `offset` tokens alone leaves the anchor's state
            if offset:
                conv.causal_conv1d_fwd(x[:, s:s + offset], weight, None, alone, torch.tensor([0, offset]),
                                       idx[i:i + 1], initial[i:i + 1], "silu")
            assert torch.equal(conv_pool[dst], alone[idx[i]])
            ref = pool_before[idx[i]].double() if offset == 0 else \
                _reference(q, k, v, g, beta, pool_before[idx[i]], s, s + offset)[1]
            assert rel_err(pool[dst], ref) < TOL
    assert anchors.written == {"conv": set(spare[:4]), "ssm": set(spare[:4])}
    untouched = spare[4:]
    assert torch.equal(pool[untouched], pool_before[untouched])
    assert torch.equal(conv_pool[untouched], conv_before[untouched])


def test_mamba2_interval_anchors_come_from_the_scans_chunk_grid():
    """Mamba2 (`families.mamba2.write_states`): a sequence starting on the packed batch's 32-token chunk grid
    (the second, after 64 tokens) gets its anchors at 32 and 64 tokens in: SSM state = the float64 recurrence after
    them, conv state = the x | B | C inputs of the 3 tokens before them through the mixer's own input projection.
    The third sequence starts off the grid: its anchor is not written (so it is freed at commit, never wrong)."""
    from types import SimpleNamespace

    from tailreplay_sglang.cache.anchors import IntervalAnchors
    from tailreplay_sglang.families.mamba2 import write_states

    lengths, chunk, H, P, N, G = [64, 100, 70], 32, 2, 4, 8, 1
    x, dt, dt_bias, A, B, C, D, pool, idx, cu = _ssd_inputs(lengths, H, P, N, G, slots=16)
    T, hidden, conv_dim, width_1 = sum(lengths), 16, H * P + 2 * G * N, 3
    h = torch.randn(T, hidden)
    weight = torch.randn(H * P + conv_dim + H, hidden)
    mixer = SimpleNamespace(in_proj=lambda rows: (rows @ weight.T, None), tp_size=1, intermediate_size=H * P,
                            conv_dim=conv_dim)
    spare = [i for i in range(16) if i not in idx.tolist()]
    cache = SimpleNamespace(conv=[torch.zeros(16, conv_dim, width_1)], temporal=pool)
    metadata = SimpleNamespace(num_prefills=3, mixed_metadata=SimpleNamespace(chunk_size=chunk),
                               query_start_loc=cu, mamba_cache_indices=idx)
    anchors = IntervalAnchors(32)
    anchors.by_slot = {int(idx[1]): [(32, spare[0]), (64, spare[1])], int(idx[2]): [(32, spare[2])]}
    initial = pool[idx].clone()
    _, chunks, _, _ = _scan(x, dt, dt_bias, A, B, C, D, initial, cu, chunk)
    write_states(anchors, mixer, h, cache, metadata, chunks)

    for offset, dst in anchors.by_slot[int(idx[1])]:
        position = 64 + offset
        state = _ssd_reference(x, dt, dt_bias, A, B, C, D, initial[1], 64, position)[1]
        assert rel_err(pool[dst], state) < TOL
        rows = h[position - width_1:position] @ weight.T
        assert torch.allclose(cache.conv[0][dst], rows[:, H * P:H * P + conv_dim].T)
        assert {dst} <= anchors.written["ssm"] and {dst} <= anchors.written["conv"]
    assert spare[2] not in anchors.written["ssm"] | anchors.written["conv"]  # 164 + 32 is off the grid


def test_thread_bind_strings_parse_like_linux_cpulists():
    from sglang_cpu_compat.threads import parse_cpu_list

    assert parse_cpu_list("0") == [0]
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list("2,0-1") == [0, 1, 2]
    with pytest.raises(ValueError, match="SGLANG_CPU_OMP_THREADS_BIND"):
        parse_cpu_list("")


# ---- Mamba2 (SSD): mamba2's SGLang-signature wrappers against the float64 recurrence (naive.naive_ssd) ----

# (lengths of the packed sequences, chunk size, heads H, head dim P, state size N, groups G)
SSD_CASES = [
    pytest.param([1], 64, 2, 4, 8, 1, id="T1-c64-H2"),
    pytest.param([63], 64, 4, 8, 16, 2, id="T63-c64-G2"),
    pytest.param([65, 3], 64, 4, 16, 8, 4, id="varlen-T65,3-c64-G4"),
    pytest.param([1, 130, 64, 7], 16, 8, 8, 16, 2, id="varlen4-c16-H8G2"),
    pytest.param([1, 130, 64, 7], 64, 4, 4, 8, 1, id="varlen4-c64-G1"),
    pytest.param([200], 16, 2, 16, 16, 2, id="T200-c16"),
]


def _ssd_inputs(lengths, H, P, N, G, slots=12):
    """Packed inputs as the mixer passes them: x [1, T, H, P], raw dt [1, T, H] (bias and softplus applied by the
    op), A [H] < 0, B, C [1, T, G, N], D [H], a pool of nonzero states, slots and cu_seqlens."""
    T = sum(lengths)
    x = torch.randn(1, T, H, P)
    dt = torch.randn(1, T, H) - 2  # softplus(dt + dt_bias) ~ 0.02..0.5
    dt_bias = torch.randn(H) * 0.5
    A = -torch.rand(H) * 0.5 - 0.05  # per-token decays exp(dt A) mostly above 0.9: states keep memory across chunks
    B, C = torch.randn(1, T, G, N), torch.randn(1, T, G, N)
    D = torch.randn(H)
    pool = torch.randn(slots, H, P, N) * 0.5  # nonzero initial states
    idx = torch.randperm(slots)[: len(lengths)]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)  # SGLang's query_start_loc
    return x, dt, dt_bias, A, B, C, D, pool, idx, cu


def _ssd_reference(x, dt, dt_bias, A, B, C, D, state, s, e, dt_limit=None):
    """Packed tokens s:e from `state` through the float64 recurrence: (y [e - s, H, P], state after them)."""
    rep = x.shape[2] // B.shape[2]
    dt64 = F.softplus(dt[0, s:e].double() + dt_bias.double())
    if dt_limit is not None:
        dt64 = dt64.clamp(*dt_limit)
    B64, C64 = (t[0, s:e].double().repeat_interleave(rep, dim=1) for t in (B, C))
    return naive.naive_ssd(x[0, s:e].double(), dt64, A.double(), B64, C64, D.double(), state.double())


def _scan(x, dt, dt_bias, A, B, C, D, initial_states, cu, chunk, track_seq_idx=None, track_end_locs=None,
          dt_limit=(0.0, float("inf"))):
    """mamba_chunk_scan_combined called as the mixer's prefill calls it: (out, per-chunk states, varlen final states,
    track states)."""
    out = torch.full_like(x, float("nan"))
    chunks, finals, track = mamba2.mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size=chunk, D=D, z=None, dt_bias=dt_bias, seq_idx=None, chunk_indices=None,
        chunk_offsets=None, cu_seqlens=cu, initial_states=initial_states, return_varlen_states=True,
        return_final_states=False, return_track_states=True, track_seq_idx=track_seq_idx,
        track_end_locs=track_end_locs, dt_softplus=True, dt_limit=dt_limit, out=out, state_dtype=torch.float32)
    return out, chunks, finals, track


@pytest.mark.parametrize("lengths,chunk,H,P,N,G", SSD_CASES)
def test_mamba_chunk_scan_combined_matches_recurrence(lengths, chunk, H, P, N, G):
    """`out`, the varlen final states and the per-chunk states equal the float64 recurrence of each sequence. The
    per-chunk states are one grid over the packed batch (how SGLang's extra_buffer reads Mamba2's: h[end // chunk]):
    row k is the state at packed position k * chunk of the sequence holding it (its initial state at its start)."""
    x, dt, dt_bias, A, B, C, D, pool, idx, cu = _ssd_inputs(lengths, H, P, N, G)
    out, chunks, finals, track = _scan(x, dt, dt_bias, A, B, C, D, pool[idx], cu, chunk)
    assert track is None
    T = sum(lengths)
    assert chunks.shape == (1, -(-T // chunk), H, P, N)
    assert finals.shape == (len(lengths), H, P, N)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    for i, (s, e) in enumerate(bounds):
        ref_y, ref_state = _ssd_reference(x, dt, dt_bias, A, B, C, D, pool[idx[i]], s, e)
        assert rel_err(out[0, s:e], ref_y) < TOL, i
        assert rel_err(finals[i], ref_state) < TOL, i
    for k, position in enumerate(range(0, T, chunk)):
        i, (s, e) = next((i, b) for i, b in enumerate(bounds) if b[0] <= position < b[1])
        state = _ssd_reference(x, dt, dt_bias, A, B, C, D, pool[idx[i]], s, position)[1]
        assert rel_err(chunks[0, k], state) < TOL, (k, i, position)


def test_mamba2_chunk_grid_spans_sequences_as_sglang_reads_it():
    """The case SGLang's extra_buffer plan hits: lengths [32, 32, 100], 64-token chunks, sequence 2 tracked after 64
    of its tokens -> h_src = (64 + 64) // 64 = 2 must hold sequence 2's state after 64 tokens, not its initial state."""
    lengths, chunk, H, P, N, G = [32, 32, 100], 64, 2, 4, 8, 1
    x, dt, dt_bias, A, B, C, D, pool, idx, cu = _ssd_inputs(lengths, H, P, N, G)
    _, chunks, _, _ = _scan(x, dt, dt_bias, A, B, C, D, pool[idx], cu, chunk)
    state = _ssd_reference(x, dt, dt_bias, A, B, C, D, pool[idx[2]], 64, 128)[1]
    assert rel_err(chunks[0, 128 // chunk], state) < TOL
    assert rel_err(chunks[0, 1], pool[idx[2]]) < TOL  # position 64 is sequence 2's start: its initial state


def test_mamba_chunk_scan_combined_track_states_are_the_states_at_the_end_locs():
    """Tracked ends are packed positions: entry j is sequence track_seq_idx[j]'s state after
    track_end_locs[j] - cu_seqlens[seq] of its tokens (mid-chunk, on a chunk boundary, at the sequence's start, at
    its end), in the order asked."""
    lengths, chunk, H, P, N, G = [100, 40, 64, 30], 32, 4, 8, 16, 2
    x, dt, dt_bias, A, B, C, D, pool, idx, cu = _ssd_inputs(lengths, H, P, N, G)
    # cu = [0, 100, 140, 204, 234]
    asked = [(0, 45), (0, 64), (2, 204), (1, 100), (1, 132), (0, 100), (3, 221), (1, 111)]
    seq_idx = torch.tensor([s for s, _ in asked])
    end_locs = torch.tensor([e for _, e in asked])
    out, chunks, finals, track = _scan(x, dt, dt_bias, A, B, C, D, pool[idx], cu, chunk, seq_idx, end_locs)
    assert track.shape == (1, len(asked), H, P, N)
    for j, (seq, end) in enumerate(asked):
        start = int(cu[seq])
        assert start <= end <= int(cu[seq + 1])
        ref = _ssd_reference(x, dt, dt_bias, A, B, C, D, pool[idx[seq]], start, end)[1]
        assert rel_err(track[0, j], ref) < TOL, (seq, end)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):  # tracking changes nothing else
        ref_y, ref_state = _ssd_reference(x, dt, dt_bias, A, B, C, D, pool[idx[i]], s, e)
        assert rel_err(out[0, s:e], ref_y) < TOL and rel_err(finals[i], ref_state) < TOL


@pytest.mark.parametrize("dt_limit", [(0.0, 0.05), (0.03, 0.2)], ids=["max0.05", "min0.03-max0.2"])
def test_mamba_chunk_scan_combined_clamps_dt_to_dt_limit(dt_limit):
    lengths, chunk = [70, 9], 16
    x, dt, dt_bias, A, B, C, D, pool, idx, cu = _ssd_inputs(lengths, 4, 8, 8, 2)
    dt = dt * 1.5  # softplus(dt + bias) on both sides of either limit
    out, _, finals, _ = _scan(x, dt, dt_bias, A, B, C, D, pool[idx], cu, chunk, dt_limit=dt_limit)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref_y, ref_state = _ssd_reference(x, dt, dt_bias, A, B, C, D, pool[idx[i]], s, e, dt_limit)
        assert rel_err(out[0, s:e], ref_y) < TOL and rel_err(finals[i], ref_state) < TOL
        unclamped_y, _ = _ssd_reference(x, dt, dt_bias, A, B, C, D, pool[idx[i]], s, e)
        assert rel_err(unclamped_y, ref_y) > 1e-3  # the limit matters in this case


def _decode_args(dt, A, dt_bias, D, P, N):
    """dt, A, dt_bias and D expanded as the mixer's decode expands them for the kernel."""
    return (dt[:, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N).float(),
            dt_bias[:, None].expand(-1, P), D[:, None].expand(-1, P))


def test_selective_state_update_is_one_recurrence_step_on_each_slot():
    """One decode token per row: out = one step of the recurrence from the row's slot, the slot holds the state after
    it; the padded row (-1) outputs zeros and writes no slot (not the last one either)."""
    H, P, N, G, slots = 4, 8, 16, 2, 9
    pool = torch.randn(slots, H, P, N)
    before = pool.clone()
    idx = torch.tensor([5, -1, 2, 7])
    b = len(idx)
    x, dt = torch.randn(1, b, H, P), torch.randn(1, b, H) - 2
    dt_bias, A, D = torch.randn(H) * 0.5, -torch.rand(H) - 0.05, torch.randn(H)
    B, C = torch.randn(1, b, G, N), torch.randn(1, b, G, N)
    out = torch.randn(b, H, P)
    dt_d, A_d, dt_bias_d, D_d = _decode_args(dt[0], A, dt_bias, D, P, N)
    mamba2.selective_state_update(pool, x[0], dt_d, A_d, B[0], C[0], D_d, z=None, dt_bias=dt_bias_d,
                                  dt_softplus=True, state_batch_indices=idx, out=out)
    for r, slot in enumerate(idx.tolist()):
        if slot < 0:
            assert torch.equal(out[r], torch.zeros(H, P))
            continue
        ref_y, ref_state = _ssd_reference(x, dt, dt_bias, A, B, C, D, before[slot], r, r + 1)
        assert rel_err(out[r], ref_y[0]) < TOL, r
        assert rel_err(pool[slot], ref_state) < TOL, r
    untouched = [s for s in range(slots) if s not in idx.tolist()]
    assert slots - 1 in untouched
    assert torch.equal(pool[untouched], before[untouched])


def test_mamba2_decode_continues_chunked_prefill():
    """Chunked prefill of two packed sequences (one with an initial state), their varlen final states written to
    their slots as the mixer does, then 3 batched decode steps == the recurrence over each whole sequence."""
    H, P, N, G, chunk, steps = 4, 8, 16, 2, 16, 3
    lengths = [50 + steps, 70 + steps]
    x, dt, dt_bias, A, B, C, D, pool, idx, cu = _ssd_inputs(lengths, H, P, N, G, slots=6)
    initial = pool[idx].clone()
    initial[1] = 0  # a new sequence: no prefix state
    before = pool.clone()
    prefill = torch.cat([torch.arange(s, e - steps) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    cu_p = torch.tensor([0] + [n - steps for n in lengths]).cumsum(0).to(torch.int32)
    out_p, _, finals, _ = _scan(x[:, prefill], dt[:, prefill], dt_bias, A, B[:, prefill], C[:, prefill], D, initial,
                                cu_p, chunk)
    pool[idx] = finals
    dt_bias_d = dt_bias[:, None].expand(-1, P)
    outs = []
    for t in range(steps):
        rows = (cu[1:] - steps + t).long()  # token t of the decode tail of each sequence
        dt_d, A_d, _, D_d = _decode_args(dt[0, rows], A, dt_bias, D, P, N)
        out = torch.empty(len(lengths), H, P)
        mamba2.selective_state_update(pool, x[0, rows], dt_d, A_d, B[0, rows], C[0, rows], D_d, z=None,
                                      dt_bias=dt_bias_d, dt_softplus=True, state_batch_indices=idx, out=out)
        outs.append(out)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref_y, ref_state = _ssd_reference(x, dt, dt_bias, A, B, C, D, initial[i], s, e)
        assert rel_err(out_p[0, cu_p[i]:cu_p[i + 1]], ref_y[:-steps]) < TOL, i
        assert rel_err(torch.stack([o[i] for o in outs]), ref_y[-steps:]) < TOL, i
        assert rel_err(pool[idx[i]], ref_state) < TOL, i
    others = [s for s in range(len(pool)) if s not in idx.tolist()]
    assert torch.equal(pool[others], before[others])


MAMBA2_INSTALL_CHECK = """
import sglang.srt.layers.attention.mamba.mamba as mixer
from sglang_cpu_compat import mamba2
mamba2.install()
assert mixer.__name__ == mamba2.MIXER_MODULE
for name, fn in [("causal_conv1d_fn", mamba2.causal_conv1d_fn), ("causal_conv1d_fn_triton", mamba2.causal_conv1d_fn),
                 ("causal_conv1d_update", mamba2.causal_conv1d_update),
                 ("causal_conv1d_update_triton", mamba2.causal_conv1d_update),
                 ("mamba_chunk_scan_combined", mamba2.mamba_chunk_scan_combined),
                 ("selective_state_update", mamba2.selective_state_update)]:
    assert getattr(mixer, name, None) is fn, name
print("ok")
"""


def test_mamba2_install_binds_the_mixer_kernel_names_under_the_cpu_engine():
    """In a fresh SGLANG_USE_CPU_ENGINE=1 interpreter (SGLang's mixer module binds none of the conv names there and
    its Triton scan cannot run), `install` binds all six names the mixer calls to sglang_cpu_compat.mamba2."""
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    out = subprocess.run([sys.executable, "-c", MAMBA2_INSTALL_CHECK], capture_output=True, text=True, timeout=180,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


# ---- KDA (Kimi Linear): ops.kda and kda's SGLang-signature wrappers against the float64 recurrence ----

# (lengths of the packed sequences, heads H, K, V)
KDA_CASES = [([5], 2, 16, 16), ([64], 3, 16, 8), ([1, 130, 64, 65], 2, 32, 16), ([200, 3], 4, 8, 24)]


def _kda_inputs(lengths, H, K, V, seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k = torch.randn(1, T, H, K, generator=g), torch.randn(1, T, H, K, generator=g)
    v = torch.randn(1, T, H, V, generator=g)
    raw_gate, raw_beta = torch.randn(1, T, H, K, generator=g) * 2, torch.randn(1, T, H, generator=g)
    A_log, dt_bias = torch.randn(H, generator=g) * 0.5, torch.randn(H * K, generator=g)
    cu = torch.tensor([0] + lengths).cumsum(0)
    return q, k, v, raw_gate, raw_beta, A_log, dt_bias, cu


def _kda_reference(q, k, v, gate, beta, initial, s, e):
    def f(x):
        return x[0, s:e].double()

    return naive.naive_recurrent_kda(f(q), f(k), f(v), gate[s:e], beta[0, s:e].double().sigmoid(),
                                     None if initial is None else initial.double(), use_qk_l2norm=True)


@pytest.mark.parametrize("lengths,H,K,V", KDA_CASES)
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_chunk_kda_matches_recurrence(lengths, H, K, V, lower_bound):
    """The chunked prefill (gate, beta and l2norm inside, states from and into pool slots, a pad slot) against the
    token-by-token recurrence in float64, on outputs, final states and the state entering every 64-token chunk."""
    q, k, v, raw_gate, raw_beta, A_log, dt_bias, cu = _kda_inputs(lengths, H, K, V, seed=len(lengths) + H)
    pool = torch.randn(8, H, V, K)
    slots = torch.tensor([7, -1, 2, 5][:len(lengths)])
    before = pool.clone()
    o, finals, h = kda.chunk_kda(q, k, v, raw_gate, raw_beta, pool, cu, slots, True, A_log=A_log, dt_bias=dt_bias,
                                 lower_bound=lower_bound, beta_is_raw=True, chunk_states=True)
    gate = kda.kda_gate(raw_gate[0].double(), A_log.double(), dt_bias.double(), lower_bound)
    row = 0
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        initial = None if slots[i] < 0 else before[slots[i]]
        ref_o, ref_state = _kda_reference(q, k, v, gate, raw_beta, initial, s, e)
        assert rel_err(o[0, s:e], ref_o) < TOL and rel_err(finals[i], ref_state) < TOL, i
        if slots[i] >= 0:
            assert rel_err(pool[slots[i]], ref_state) < TOL
        for c in range(0, e - s, 64):  # h: the state entering each chunk
            entering = initial if c == 0 else _kda_reference(q, k, v, gate, raw_beta, initial, s, s + c)[1]
            expected = torch.zeros(H, V, K) if entering is None else entering
            assert rel_err(h[0, row], expected) < TOL, (i, c)
            row += 1
    assert row == h.shape[1]


def test_kda_gate_formulas():
    raw, A_log, dt_bias = torch.randn(5, 2, 4), torch.randn(2), torch.randn(8)
    x = raw + dt_bias.view(2, 4)
    assert torch.allclose(kda.kda_gate(raw, A_log, dt_bias), -A_log.exp()[:, None] * F.softplus(x))
    assert torch.allclose(kda.kda_gate(raw, A_log, dt_bias, -5.0), -5.0 * torch.sigmoid(A_log.exp()[:, None] * x))


def test_kda_decode_continues_chunked_prefill():
    """SGLang's decode entry (cpu.kda.fused_sigmoid_gating_delta_rule_update, raw gate [T, H * K], beta [1, T, H])
    continues the prefill's states one token per slot: the whole equals the recurrence over prompt + steps."""
    lengths, H, K, V, steps = [70, 9], 2, 16, 8, 3
    q, k, v, raw_gate, raw_beta, A_log, dt_bias, cu = _kda_inputs([n + steps for n in lengths], H, K, V, seed=9)
    pool, slots = torch.zeros(4, H, V, K), torch.tensor([3, 1])
    rows = [torch.arange(s, s + n) for s, n in zip(cu[:-1].tolist(), lengths)]
    prefill = torch.cat(rows)
    cu_p = torch.tensor([0] + lengths).cumsum(0)
    out_p = cpu_kda.chunk_kda(q[:, prefill], k[:, prefill], v[:, prefill], raw_gate[:, prefill],
                              raw_beta[:, prefill], initial_state=pool, initial_state_indices=slots,
                              use_qk_l2norm_in_kernel=True, cu_seqlens=cu_p, A_log=A_log, dt_bias=dt_bias,
                              beta_is_raw=True)
    outs = []
    for step in range(steps):
        at = torch.tensor([s + n + step for s, n in zip(cu[:-1].tolist(), lengths)])
        outs.append(cpu_kda.fused_sigmoid_gating_delta_rule_update(
            A_log, dt_bias, q[:, at], k[:, at], v[:, at], raw_gate[0, at].reshape(len(at), -1), raw_beta[:, at],
            pool, slots, use_qk_l2norm_in_kernel=True, is_kda=True))
    gate = kda.kda_gate(raw_gate[0].double(), A_log.double(), dt_bias.double())
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref_o, ref_state = _kda_reference(q, k, v, gate, raw_beta, None, s, e)
        assert rel_err(out_p[0, cu_p[i]:cu_p[i + 1]], ref_o[:-steps]) < TOL, i
        assert rel_err(torch.stack([o[0, i] for o in outs]), ref_o[-steps:]) < TOL, i
        assert rel_err(pool[slots[i]], ref_state) < TOL, i


def test_chunk_kda_track_state_snapshots_the_chunk_sglang_asks_for():
    """extra_buffer's `track_state[n]` = sequence n's state entering its chunk `track_chunk_idx[n]` (-1: none), the
    row of `h` SGLang reads otherwise."""
    lengths, H, K, V = [130, 5, 200], 2, 8, 8
    q, k, v, raw_gate, raw_beta, A_log, dt_bias, cu = _kda_inputs(lengths, H, K, V, seed=4)
    track = torch.full((3, H, V, K), 7.0)
    o, h = cpu_kda.chunk_kda(q, k, v, raw_gate, raw_beta, initial_state=torch.zeros(3, H, V, K),
                             initial_state_indices=torch.arange(3), use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                             A_log=A_log, dt_bias=dt_bias, beta_is_raw=True, output_intermediate_states=True,
                             track_state=track, track_chunk_idx=torch.tensor([2, -1, 1]))
    assert torch.equal(track[0], h[0, 2]) and torch.equal(track[2], h[0, 3 + 1 + 1])
    assert torch.all(track[1] == 7.0)


KDA_INSTALL_CHECK = """
import sglang.srt.layers.attention.linear.kernels.kda_triton as kernels
from sglang_cpu_compat import kda
kda.install()
assert kernels.__name__ == kda.KERNEL_MODULE
assert kernels.chunk_kda is kda.chunk_kda
assert kernels.fused_sigmoid_gating_delta_rule_update is kda.fused_sigmoid_gating_delta_rule_update
print("ok")
"""


def test_kda_install_binds_the_kernel_names_under_the_cpu_engine():
    """In a fresh SGLANG_USE_CPU_ENGINE=1 interpreter, where SGLang's KDA kernel module imports neither kernel."""
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    out = subprocess.run([sys.executable, "-c", KDA_INSTALL_CHECK], capture_output=True, text=True, timeout=180,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
