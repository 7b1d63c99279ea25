"""Replay kernels (tailreplay_sglang.kernels) against float64 token-by-token references.

- `test_triton_*`: the Triton kernels. On a CPU-only machine they run under TRITON_INTERPRET=1 in float32, in a child
  pytest started by `test_triton_kernels_under_interpreter` (Triton reads the variable when it is first imported,
  so setting it in this process would switch every later Triton user of the session to the interpreter). With CUDA
  they run natively here, in float32 and bfloat16.
- `test_sm90_compile_*`: the kernels compiled for an H100/H200 (sm_90) without a GPU (ptxas ships with Triton), so
  errors that only the GPU compiler raises show up on CPU too.
- `test_torch_*`: the torch CPU path of the replay, the function the server calls on CPU.
Every tail starts from the states in its mamba slot. Pools are NaN except at the tails' slots, which hold zeros (a
slot SGLang cleared: `cleared` cases) or random states (an anchor's states copied in: `anchor` cases): a kernel that
reads or writes any other slot shows up as NaN, one that ignores the slot's state fails the `anchor` cases, and
`test_*_anchored_replay_*` check the point of it all: anchor prefix, then tail from the slot == whole sequence.
"""

import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.autotuner import Heuristics

from helpers import rel_err
from tailreplay_sglang import kernels
from tailreplay_sglang.ops import conv as ops_conv
from tailreplay_sglang.ops import gdn as ops_gdn
from tailreplay_sglang.ops import lightning as ops_lightning

TOL = 1e-5
BF16_TOL = 2e-2  # bfloat16 inputs and outputs, TF32 dots; the reference sees the same rounded inputs
NUM_SLOTS = 16
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA and not INTERPRETED else "cpu"
triton_runs_here = pytest.mark.skipif(
    not (INTERPRETED or HAS_CUDA),
    reason="CPU: runs in the TRITON_INTERPRET=1 child of test_triton_kernels_under_interpreter",
)
needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")

# (tail lengths, key heads H, value heads HV, K, V, chunk size BT); most lengths are off chunk boundaries
GDN_CASES = [
    pytest.param([1], 1, 2, 16, 16, 16, id="T1"),
    pytest.param([37], 1, 2, 32, 32, 64, id="T37-BT64"),
    pytest.param([5, 40, 1, 100], 2, 4, 32, 32, 16, id="varlen4"),
    pytest.param([300, 17], 1, 2, 32, 48, 16, id="varlen2-T300-V48"),
    pytest.param([63, 1, 17, 90, 33, 5, 120, 64], 2, 4, 24, 16, 16, id="varlen8-K24"),
]
# (tail lengths, H, HV, K, V) for a whole layer: conv then GDN
LAYER_CASES = [
    pytest.param([3, 70, 1], 2, 4, 16, 16, id="varlen3"),
    pytest.param([130], 1, 2, 32, 32, id="T130"),
]
RANDOM_SEEDS = [0, 1, 2, 3]
# (anchor prefix lengths, tail lengths, H, HV, K, V): the conv's width - 1 is 3, so 1 and 2 are prefixes and tails
# shorter than a conv state, whose states mix the anchor's context and the tail's inputs
ANCHOR_CASES = [
    pytest.param([40, 2, 17, 1], [30, 1, 64, 2], 2, 4, 16, 16, id="varlen4-short"),
    pytest.param([100], [37], 1, 2, 32, 32, id="T100+37"),
]
# what the tails' slots hold before the replay: zeros (SGLang cleared them) or an anchor's states (random here)
INITIAL = ["cleared", "anchor"]


def _tails(lengths, device):
    """cu_seqlens [N + 1] int32 and N distinct random mamba slots."""
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return cu.to(device), torch.randperm(NUM_SLOTS)[: len(lengths)].to(device)


def _gates(T, HV):
    """Raw a, b and A_log, dt_bias giving decays of about 0.87-0.999: states remember across chunks."""
    a, b = torch.randn(T, HV), torch.randn(T, HV)
    A_log, dt_bias = torch.empty(HV).uniform_(0.01, 0.2).log(), torch.randn(HV) - 2
    return a, b, A_log, dt_bias


def _nan_pool(*shape, device, dtype=torch.float32):
    return torch.full((NUM_SLOTS, *shape), float("nan"), dtype=dtype, device=device)


def _initial_states(initial: str, N: int, *shape):
    """[N, *shape] random states for `anchor`; None (zeros, the references' default) for `cleared`."""
    return torch.randn(N, *shape) if initial == "anchor" else None


def _slot_pool(pool, slots, states=None):
    """`pool` (NaN) with the tails' slots holding `states` ([N, ...]) or zeros when None; returns the pool."""
    pool[slots] = 0. if states is None else states.to(device=pool.device, dtype=pool.dtype)
    return pool


def _f64_or_none(states, dtype=torch.float32):
    """The reference's view of initial states: as the pool of `dtype` stores them, in float64."""
    return None if states is None else states.to(dtype).double()


def _assert_only_slots_written(pool, slots):
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert pool[untouched.to(pool.device)].isnan().all()


def _f64(*tensors):
    return [t.detach().double().cpu() for t in tensors]


def _random_layer_case(seed: int):
    """(lengths, H, HV, K, V, conv width) drawn from `seed`: 1-4 tails of 1-80 tokens, the first shorter than the
    conv state (width - 1) whenever the width allows it."""
    gen = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    width = pick([2, 3, 4])
    lengths = torch.randint(1, 81, (pick([1, 2, 3, 4]),), generator=gen).tolist()
    if width > 2:
        lengths[0] = pick(list(range(1, width - 1)))
    H = pick([1, 2])
    return lengths, H, H * pick([1, 2, 3]), pick([8, 16, 24, 32]), pick([8, 16, 24, 48]), width


def _tail_tokens(prefix_lens, tail_lens):
    """Indices of the tails' tokens in the packed whole sequences (prefix i then tail i)."""
    starts = torch.tensor([0] + [p + t for p, t in zip(prefix_lens, tail_lens)]).cumsum(0)
    return torch.cat([torch.arange(s + p, s + p + t) for s, p, t in zip(starts.tolist(), prefix_lens, tail_lens)])


def _split_anchored(layer_inputs, prefix_lens, tail_lens):
    """Layer inputs of whole sequences -> ((prefix inputs, cu), (tail inputs, cu), cu of the whole sequences).

    The token tensors (mixed_qkv, a, b: the first three) are split, the weights shared."""
    tail = _tail_tokens(prefix_lens, tail_lens)
    is_prefix = torch.ones(sum(prefix_lens) + sum(tail_lens), dtype=torch.bool)
    is_prefix[tail] = False

    def cu(lengths):
        return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)

    def part(tokens):
        return [x[tokens] for x in layer_inputs[:3]] + list(layer_inputs[3:])

    whole = [p + t for p, t in zip(prefix_lens, tail_lens)]
    return (part(is_prefix), cu(prefix_lens)), (part(tail), cu(tail_lens)), cu(whole)


# ---- Triton kernels ----

@pytest.mark.skipif(INTERPRETED or HAS_CUDA, reason="the child itself, or CUDA runs the kernels natively")
def test_triton_kernels_under_interpreter(tmp_path):
    """Runs this file's `test_triton_*` tests in a child pytest with TRITON_INTERPRET=1 (float32, CPU tensors)."""
    report = tmp_path / "child.xml"
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", "test_triton_",
           f"--junitxml={report}"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(cmd, env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    # A child that skipped everything also exits 0: every test it collected must have passed, except the ones that
    # need a real GPU, and those only for that reason.
    cases = ElementTree.parse(report).getroot().iter("testcase")
    outcomes = {case.get("name"): [child.get("message", child.tag) for child in case] for case in cases
                if case.get("name") != "test_triton_kernels_under_interpreter"}
    passed = [name for name, marks in outcomes.items() if not marks]
    skipped = {name: marks for name, marks in outcomes.items() if marks}
    expected = [name for name in outcomes if name.startswith("test_triton_")]
    assert len(outcomes) == len(expected) >= 40, sorted(outcomes)
    assert all(marks == ["needs a CUDA GPU"] for marks in skipped.values()), skipped
    assert len(passed) == len(expected) - len(skipped) >= 40, (len(passed), len(skipped))


@triton_runs_here
@pytest.mark.parametrize("initial", INITIAL)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("lengths,width", [([1], 4), ([2, 3, 1], 4), ([17, 2, 40, 70], 4), ([1, 5, 33], 2),
                                           ([1, 2, 64, 3], 5)],
                         ids=["T1", "all-shorter-than-width", "varlen4", "width2", "width5"])
def test_triton_replay_causal_conv1d_matches_reference(lengths, width, with_bias, initial):
    dim = 40  # not a multiple of the block
    x, weight = torch.randn(sum(lengths), dim), torch.randn(dim, width)
    bias = torch.randn(dim) if with_bias else None
    cu, slots = _tails(lengths, DEVICE)
    init = _initial_states(initial, len(lengths), dim, width - 1)
    # dim-contiguous pool, as SGLang may lay it out: the kernel takes strides
    states = _slot_pool(_nan_pool(width - 1, dim, device=DEVICE).transpose(1, 2), slots, init)
    y = kernels.replay_causal_conv1d(x.to(DEVICE), weight.to(DEVICE), None if bias is None else bias.to(DEVICE),
                                     cu, slots, states)
    ref_y, ref_states = kernels.naive_replay_causal_conv1d(*_f64(x, weight), None if bias is None else bias.double(),
                                                           cu.cpu(), _f64_or_none(init))
    assert rel_err(y.cpu(), ref_y) < TOL
    # a copy of the last inputs, preceded by the end of the initial context where the tail is shorter than it
    assert torch.equal(states[slots].cpu().double(), ref_states)
    _assert_only_slots_written(states, slots)


def _gdn_inputs(lengths, H, HV, K, V):
    T = sum(lengths)
    return (torch.randn(T, H, K), torch.randn(T, H, K), torch.randn(T, HV, V), *_gates(T, HV))


@triton_runs_here
@pytest.mark.parametrize("initial", INITIAL)
@pytest.mark.parametrize("lengths,H,HV,K,V,BT", GDN_CASES)
def test_triton_gdn_replay_matches_recurrence(lengths, H, HV, K, V, BT, initial):
    inputs = _gdn_inputs(lengths, H, HV, K, V)
    cu, slots = _tails(lengths, DEVICE)
    init = _initial_states(initial, len(lengths), HV, V, K)
    pool, pool_state_only = (_slot_pool(_nan_pool(HV, V, K, device=DEVICE), slots, init) for _ in range(2))
    args = [x.to(DEVICE) for x in inputs] + [cu, slots]
    o = kernels.gdn_replay_fwd(*args, pool, chunk_size=BT)
    assert kernels.gdn_replay_fwd(*args, pool_state_only, state_only=True, chunk_size=BT) is None
    ref_o, ref_states = kernels.naive_gdn_replay(*_f64(*inputs), cu.cpu(), initial_states=_f64_or_none(init))
    assert o.shape == inputs[2].shape and rel_err(o.cpu(), ref_o) < TOL
    assert rel_err(pool[slots].cpu(), ref_states) < TOL
    assert rel_err(pool_state_only[slots].cpu(), ref_states) < TOL
    _assert_only_slots_written(pool, slots)
    _assert_only_slots_written(pool_state_only, slots)


@needs_cuda
@pytest.mark.parametrize("initial", INITIAL)
@pytest.mark.parametrize("lengths,H,HV,K,V,BT", GDN_CASES[2:])
def test_triton_gdn_replay_bfloat16(lengths, H, HV, K, V, BT, initial):
    inputs = [x.to(torch.bfloat16) for x in _gdn_inputs(lengths, H, HV, K, V)]
    cu, slots = _tails(lengths, DEVICE)
    init = _initial_states(initial, len(lengths), HV, V, K)
    pool = _slot_pool(_nan_pool(HV, V, K, device=DEVICE), slots, init)  # float32 states, as SGLang keeps them
    o = kernels.gdn_replay_fwd(*[x.to(DEVICE) for x in inputs], cu, slots, pool, chunk_size=BT)
    ref_o, ref_states = kernels.naive_gdn_replay(*_f64(*inputs), cu.cpu(), initial_states=_f64_or_none(init))
    assert o.dtype == torch.bfloat16 and rel_err(o.cpu(), ref_o) < BF16_TOL
    assert rel_err(pool[slots].cpu(), ref_states) < BF16_TOL


def _layer_inputs(lengths, H, HV, K, V, width=4):
    T, conv_dim = sum(lengths), 2 * H * K + HV * V
    mixed_qkv = torch.randn(T, conv_dim)
    conv_weight, conv_bias = torch.randn(conv_dim, width) * 0.5, torch.randn(conv_dim) * 0.1
    a, b, A_log, dt_bias = _gates(T, HV)
    return mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias


def _check_layer_replay(replay, lengths, H, HV, K, V, state_only, device, dtype=torch.float32, tol=TOL,
                        initial="cleared", width=4):
    """replay(...) from the slots' states vs naive_replay_gdn_layer: outputs, and both pools written at the tails'
    slots only."""
    inputs = [x.to(dtype) for x in _layer_inputs(lengths, H, HV, K, V, width)]
    cu, slots = _tails(lengths, device)
    conv_dim = inputs[0].shape[1]
    conv_init = _initial_states(initial, len(lengths), conv_dim, width - 1)
    ssm_init = _initial_states(initial, len(lengths), HV, V, K)
    conv_states = _slot_pool(_nan_pool(conv_dim, width - 1, device=device, dtype=dtype), slots, conv_init)
    ssm_states = _slot_pool(_nan_pool(HV, V, K, device=device), slots, ssm_init)
    o = replay(*[x.to(device) for x in inputs], cu, slots, conv_states, ssm_states, state_only=state_only)
    ref_o, ref_conv, ref_ssm = kernels.naive_replay_gdn_layer(*_f64(*inputs), cu.cpu(), HV, V, K,
                                                              _f64_or_none(conv_init, dtype), _f64_or_none(ssm_init))
    assert o is None if state_only else rel_err(o.cpu(), ref_o) < tol
    assert torch.equal(conv_states[slots].cpu().double(), ref_conv)
    assert rel_err(ssm_states[slots].cpu(), ref_ssm) < tol
    _assert_only_slots_written(conv_states, slots)
    _assert_only_slots_written(ssm_states, slots)


def _check_anchored_replay(replay, prefix_lens, tail_lens, H, HV, K, V, device, tol=TOL):
    """The anchored replay: each anchor prefix replayed (state only) from a cleared slot, then each tail from the
    states it left there == the whole sequences replayed from zero (float64 reference): the tails' outputs, the
    final conv states (exact copies of inputs) and the final recurrent states."""
    inputs = _layer_inputs([p + t for p, t in zip(prefix_lens, tail_lens)], H, HV, K, V)
    (prefix, cu_prefix), (tail, cu_tail), cu_whole = _split_anchored(inputs, prefix_lens, tail_lens)
    _, slots = _tails(prefix_lens, device)
    conv_states = _slot_pool(_nan_pool(inputs[0].shape[1], inputs[3].shape[1] - 1, device=device), slots)
    ssm_states = _slot_pool(_nan_pool(HV, V, K, device=device), slots)
    pools = (slots, conv_states, ssm_states)
    assert replay(*[x.to(device) for x in prefix], cu_prefix.to(device), *pools, state_only=True) is None
    o = replay(*[x.to(device) for x in tail], cu_tail.to(device), *pools)
    ref_o, ref_conv, ref_ssm = kernels.naive_replay_gdn_layer(*_f64(*inputs), cu_whole, HV, V, K)
    assert rel_err(o.cpu(), ref_o[_tail_tokens(prefix_lens, tail_lens)]) < tol
    assert torch.equal(conv_states[slots].cpu().double(), ref_conv)
    assert rel_err(ssm_states[slots].cpu(), ref_ssm) < tol
    _assert_only_slots_written(conv_states, slots)
    _assert_only_slots_written(ssm_states, slots)


@triton_runs_here
@pytest.mark.parametrize("initial", INITIAL)
@pytest.mark.parametrize("state_only", [False, True], ids=["with-output", "state-only"])
@pytest.mark.parametrize("lengths,H,HV,K,V", LAYER_CASES[:1])  # the GDN kernel's own cases cover the shapes
def test_triton_replay_gdn_layer_matches_reference(lengths, H, HV, K, V, state_only, initial):
    _check_layer_replay(kernels.replay_gdn_layer_triton, lengths, H, HV, K, V, state_only, DEVICE, initial=initial)


@triton_runs_here
@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_triton_replay_gdn_layer_random_shapes_from_slot_states(seed):
    lengths, H, HV, K, V, width = _random_layer_case(seed)
    _check_layer_replay(kernels.replay_gdn_layer_triton, lengths, H, HV, K, V, False, DEVICE, initial="anchor",
                        width=width)


@triton_runs_here
@pytest.mark.parametrize("prefix_lens,tail_lens,H,HV,K,V", ANCHOR_CASES)
def test_triton_anchored_replay_equals_whole_sequence(prefix_lens, tail_lens, H, HV, K, V):
    _check_anchored_replay(kernels.replay_gdn_layer_triton, prefix_lens, tail_lens, H, HV, K, V, DEVICE)


def _fla_chunk_contract(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                        state_v_first, cu_seqlens, cu_seqlens_cpu=None):
    """fla-core's `chunk_gated_delta_rule` as its documentation states it, for the arguments the replay passes, on
    the torch op (checked against the float64 recurrence above): fla's kernels neither run on a CPU nor under the
    interpreter (they autotune on a device and loop over tensors the interpreter gives as ints)."""
    assert output_final_state and use_qk_l2norm_in_kernel and state_v_first and cu_seqlens.dtype == torch.int64
    assert initial_state.dtype == torch.float32 and g.dtype == beta.dtype == torch.float32
    assert cu_seqlens_cpu is None or torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
    start = initial_state.clone()
    o, final = ops_gdn.chunk_gated_delta_rule(q, k, v, g, beta, start, cu_seqlens, use_qk_l2norm_in_kernel=True)
    return o, final


@pytest.mark.parametrize("initial", INITIAL)
@pytest.mark.parametrize("state_only", [False, True], ids=["with-output", "state-only"])
def test_the_chunk_kernel_path_replays_from_the_slots_and_writes_them_back(state_only, initial, monkeypatch):
    """What the replay does around fla's chunk kernel (gates, each tail's state gathered from its slot in SGLang's
    value-major layout and the final one written back), with fla's kernel stood in for by its documented contract
    (`_fla_chunk_contract`), against the float64 reference: outputs, and the slots and nothing else written. The real
    kernel runs this path on a GPU (`test_triton_replay_gdn_layer_bfloat16_on_the_chunk_kernel`)."""
    import fla.ops.gated_delta_rule as fla_gdn

    from tailreplay_sglang.kernels import replay

    monkeypatch.setattr(fla_gdn, "chunk_gated_delta_rule", _fla_chunk_contract)
    monkeypatch.setattr(replay, "CHUNK_KERNEL_FROM", 0)
    monkeypatch.setattr(replay, "replay_causal_conv1d", _conv_on_torch)
    _check_layer_replay(kernels.replay_gdn_layer_triton, [3, 70, 1], 2, 4, 32, 32, state_only, "cpu",
                        initial=initial)


def _conv_on_torch(mixed_qkv, conv_weight, conv_bias, cu_seqlens, slots, conv_states, max_seqlen):
    """The replay's conv (Triton elsewhere) on the torch op, for the CPU test of the path around fla's kernel."""
    from_slot = torch.ones(len(slots), dtype=torch.bool)
    return ops_conv.causal_conv1d_fwd(mixed_qkv.T, conv_weight, conv_bias, conv_states, cu_seqlens, slots, from_slot,
                                      "silu").T


@needs_cuda
@pytest.mark.parametrize("initial", INITIAL)
def test_triton_replay_gdn_layer_bfloat16_on_the_chunk_kernel(initial, monkeypatch):
    """fla's chunk kernel itself on the replay's path (a lent GPU: scripts/gpu_check.sh runs this file natively)."""
    from tailreplay_sglang.kernels import replay

    monkeypatch.setattr(replay, "CHUNK_KERNEL_FROM", 0)
    _check_layer_replay(kernels.replay_gdn_layer, [3, 70, 1], 2, 4, 32, 32, False, "cuda", dtype=torch.bfloat16,
                        tol=BF16_TOL, initial=initial)


def test_a_replay_takes_the_chunk_kernel_only_past_the_measured_crossover(monkeypatch):
    """The dispatch: this package's kernel up to `CHUNK_KERNEL_FROM` tokens in the longest tail (4,096: between the
    H200's 2,048, where it was 1.7x faster than fla's, and 8,192, where fla's was 2x faster), fla's past it."""
    from tailreplay_sglang.kernels import replay

    calls = []
    monkeypatch.setattr(replay, "gdn_replay_fwd", lambda *a, **kw: calls.append("project"))
    monkeypatch.setattr(replay, "gdn_replay_chunk_kernel", lambda *a, **kw: calls.append("fla"))
    for longest in (1, 2048, 4096, 4097, 32768):
        replay.gdn_replay(*[None] * 10, max_seqlen=longest)
    assert kernels.CHUNK_KERNEL_FROM == 4096 and calls == ["project"] * 3 + ["fla"] * 2


@needs_cuda
@pytest.mark.parametrize("initial", INITIAL)
@pytest.mark.parametrize("state_only", [False, True], ids=["with-output", "state-only"])
def test_triton_replay_gdn_layer_bfloat16_through_dispatch(state_only, initial):
    _check_layer_replay(kernels.replay_gdn_layer, [3, 70, 1], 2, 4, 32, 32, state_only, "cuda",
                        dtype=torch.bfloat16, tol=BF16_TOL, initial=initial)


# ---- GPU compilation, without a GPU ----

def _compile_for_sm90(kernel, signature: str, **constexprs):
    """triton.compile for sm_90. signature: "name:type" of each runtime argument (constexprs given as keywords)."""
    fn = kernel.fn if isinstance(kernel, Heuristics) else kernel
    types = {**dict(item.split(":") for item in signature.split()), **{name: "constexpr" for name in constexprs}}
    src = ASTSource(fn=fn, signature={name: types[name] for name in fn.arg_names},
                    constexprs={(fn.arg_names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))


not_in_interpreter = pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")


@not_in_interpreter
@pytest.mark.parametrize("dtype,state_only", [("bf16", False), ("bf16", True), ("fp32", False)])
def test_sm90_compile_gdn_replay_kernel(dtype, state_only):
    tensors = f"q:*{dtype} k:*{dtype} v:*{dtype} a:*{dtype} b:*{dtype} A_log:*fp32 dt_bias:*fp32"
    output = {"o": None} if state_only else {}
    signature = tensors + ("" if state_only else f" o:*{dtype}") + " ht:*fp32 cu_seqlens:*i32 slots:*i64 " \
        "stride_q:i64 stride_k:i64 stride_v:i64 stride_a:i64 stride_b:i64 stride_ht:i64 scale:fp32 beta_scale:fp32"
    _compile_for_sm90(kernels.gdn.gdn_replay_fwd_kernel, signature, **output, H=16, HV=32, K=128, V=128, BT=16,
                      BK=128, BV=32, STORE_OUTPUT=not state_only, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")


@not_in_interpreter
def test_sm90_compile_conv_kernel():
    _compile_for_sm90(kernels.conv.replay_causal_conv1d_kernel,
                      "x:*bf16 weight:*bf16 bias:*bf16 y:*bf16 init:*bf16 conv_states:*bf16 cu_seqlens:*i32 "
                      "slots:*i64 stride_x:i64 stride_w:i64 stride_y:i64 stride_i:i64 stride_i_d:i64 stride_i_w:i64 "
                      "stride_s:i64 stride_s_d:i64 stride_s_w:i64 D:i32",
                      W=4, BW=4, BT=32, BD=128, HAS_BIAS=True)


# ---- torch CPU path ----

@pytest.mark.parametrize("initial", INITIAL)
@pytest.mark.parametrize("state_only", [False, True], ids=["with-output", "state-only"])
@pytest.mark.parametrize("lengths,H,HV,K,V,BT", GDN_CASES)
def test_torch_gdn_replay_matches_recurrence(lengths, H, HV, K, V, BT, state_only, initial):
    inputs = _gdn_inputs(lengths, H, HV, K, V)
    cu, _ = _tails(lengths, "cpu")
    init = _initial_states(initial, len(lengths), HV, V, K)
    given = None if init is None else init.clone()  # updated in place with the final states
    o, states = kernels.gdn_replay_torch(*inputs, cu, state_only=state_only, initial_states=given)
    ref_o, ref_states = kernels.naive_gdn_replay(*_f64(*inputs), cu, initial_states=_f64_or_none(init))
    assert o is None if state_only else rel_err(o, ref_o) < TOL
    assert states.dtype == torch.float32 and rel_err(states, ref_states) < TOL
    assert given is None or torch.equal(given, states)


@pytest.mark.parametrize("state_only", [False, True], ids=["with-output", "state-only"])
@pytest.mark.parametrize("lengths,H,HV,K,V",
                         LAYER_CASES + [pytest.param([300, 17, 64], 1, 2, 32, 48, id="varlen3-T300")])
@pytest.mark.parametrize("initial", INITIAL)
def test_torch_replay_gdn_layer_matches_reference(lengths, H, HV, K, V, state_only, initial):
    """Through the dispatcher, as the server calls it: CPU tensors take the torch path."""
    _check_layer_replay(kernels.replay_gdn_layer, lengths, H, HV, K, V, state_only, "cpu", initial=initial)


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_torch_replay_gdn_layer_random_shapes_from_slot_states(seed):
    lengths, H, HV, K, V, width = _random_layer_case(seed)
    _check_layer_replay(kernels.replay_gdn_layer, lengths, H, HV, K, V, False, "cpu", initial="anchor", width=width)


@pytest.mark.parametrize("prefix_lens,tail_lens,H,HV,K,V", ANCHOR_CASES)
def test_torch_anchored_replay_equals_whole_sequence(prefix_lens, tail_lens, H, HV, K, V):
    _check_anchored_replay(kernels.replay_gdn_layer, prefix_lens, tail_lens, H, HV, K, V, "cpu")


@pytest.mark.parametrize("prefix_lens,tail_lens,H,HV,K,V", ANCHOR_CASES)
def test_naive_anchored_replay_equals_whole_sequence(prefix_lens, tail_lens, H, HV, K, V):
    """The references' own initial states, in float64: anchor prefix, then tail from its states == whole sequence."""
    inputs = _f64(*_layer_inputs([p + t for p, t in zip(prefix_lens, tail_lens)], H, HV, K, V))
    (prefix, cu_prefix), (tail, cu_tail), cu_whole = _split_anchored(inputs, prefix_lens, tail_lens)
    _, conv_anchor, ssm_anchor = kernels.naive_replay_gdn_layer(*prefix, cu_prefix, HV, V, K)
    o, conv, ssm = kernels.naive_replay_gdn_layer(*tail, cu_tail, HV, V, K, conv_anchor, ssm_anchor)
    ref_o, ref_conv, ref_ssm = kernels.naive_replay_gdn_layer(*inputs, cu_whole, HV, V, K)
    assert rel_err(o, ref_o[_tail_tokens(prefix_lens, tail_lens)]) < 1e-12
    assert torch.equal(conv, ref_conv) and rel_err(ssm, ref_ssm) < 1e-12


# ---- OLMo-Hybrid's negative eigenvalues: beta = 2 sigmoid(b), in (0, 2) ----

def _check_beta_scale_2(gdn_replay, device):
    lengths = [5, 40, 100]
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(lengths, 2, 4, 32, 32)
    b = b + 2  # sigmoid(b) mostly above 1/2, so beta mostly above 1
    cu, slots = _tails(lengths, device)
    init = _initial_states("anchor", len(lengths), 4, 32, 32)
    pool = _slot_pool(_nan_pool(4, 32, 32, device=device), slots, init)
    o = gdn_replay([x.to(device) for x in (q, k, v, a, b, A_log, dt_bias)], cu, slots, pool)
    ref_o, ref_states = kernels.naive_gdn_replay(*_f64(q, k, v, a, b, A_log, dt_bias), cu.cpu(),
                                                 initial_states=_f64_or_none(init), beta_scale=2.0)
    ref_sigmoid_only, _ = kernels.naive_gdn_replay(*_f64(q, k, v, a, b, A_log, dt_bias), cu.cpu(),
                                                   initial_states=_f64_or_none(init))
    assert rel_err(o.cpu(), ref_o) < TOL and rel_err(pool[slots].cpu(), ref_states) < TOL
    assert rel_err(o.cpu(), ref_sigmoid_only) > 1e-2  # the scale is not silently dropped


@triton_runs_here
def test_triton_gdn_replay_beta_scale_2_matches_recurrence():
    _check_beta_scale_2(lambda x, cu, slots, pool: kernels.gdn_replay_fwd(*x, cu, slots, pool, beta_scale=2.0),
                        DEVICE)


def test_torch_gdn_replay_beta_scale_2_matches_recurrence():
    _check_beta_scale_2(lambda x, cu, slots, pool: kernels.gdn_replay_torch(
        *x, cu, initial_states=pool, initial_state_indices=slots, beta_scale=2.0)[0], "cpu")


# SGLang's seg_la kernel file: standalone Triton (torch, triton, dataclasses), so a GPU machine without SGLang runs it
# when the file travels with the tree (scripts/gpu_check.sh: `carry` it). Its prefill kernel does not run under
# TRITON_INTERPRET=1 (its scalar-masked state load: "mask has unsupported dtype"), so only a GPU checks it.
SEG_LA_FILE = (Path(__file__).resolve().parents[1] / ".venv/lib/python3.11/site-packages/sglang/kernels/ops/attention"
               / "linear/seg_la.py")


@pytest.mark.skipif(not torch.cuda.is_available() or not SEG_LA_FILE.exists(),
                    reason="needs a CUDA GPU and SGLang's seg_la.py (installed, or carried to the device)")
def test_sglangs_triton_seg_la_is_what_the_torch_scan_computes():
    """The kernel the replay calls on a GPU against the scan the CPU port and the interval anchors use: a packed
    prefill continuing one slot and starting another from zero, then a decode step, at Ling-2.5's 128-wide heads."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("seg_la_kernel", SEG_LA_FILE)
    kernel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel)
    torch.manual_seed(3)
    H, D, lengths = 4, 128, [300, 77]
    q, k, v = (torch.randn(sum(lengths), H, D, device="cuda") * 0.3 for _ in range(3))
    pool = torch.randn(4, H, D, D, device="cuda") * 0.1
    before = pool.clone()
    slope = torch.logspace(0, -4, H).reshape(H, 1, 1).cuda()  # memories from about 1 token to about 10^4
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    meta = kernel.SegLaMeta(batch_size=2, max_q_length=None, q_offsets=cu, q_lengths=cu.diff(),
                            s_offsets=torch.tensor([3, 1], dtype=torch.int32, device="cuda"),
                            s_scales=torch.tensor([1, 0], dtype=torch.int32, device="cuda"))
    o = kernel.seg_la_fwd(q, k, v, pool, slope, meta, softmax_scale=D ** -0.5)
    for (start, end), slot, entering in (((0, 300), 3, before[3]), ((300, 377), 1, torch.zeros_like(before[1]))):
        ref_o, ref_final, _ = ops_lightning.scan(q[start:end], k[start:end], v[start:end], slope, entering, D ** -0.5)
        assert rel_err(o[start:end], ref_o) < 1e-4 and rel_err(pool[slot], ref_final) < 1e-4
    step = [t[:1].clone() for t in (q, k, v)]
    decode_meta = kernel.SegLaMeta(batch_size=1, max_q_length=None,
                                   q_offsets=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                                   q_lengths=torch.ones(1, dtype=torch.int32, device="cuda"),
                                   s_offsets=torch.tensor([3], dtype=torch.int32, device="cuda"),
                                   s_scales=torch.ones(1, dtype=torch.int32, device="cuda"))
    state = pool[3].clone()
    o_step = kernel.seg_la_fwd(*step, pool, slope, decode_meta, softmax_scale=D ** -0.5)
    ref_o, ref_final, _ = ops_lightning.scan(*step, slope, state, D ** -0.5)
    assert rel_err(o_step, ref_o) < 1e-4 and rel_err(pool[3], ref_final) < 1e-4
