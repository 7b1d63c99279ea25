"""The CPU port's GDN and KDA target verifies (speculative decoding) against a float64 replay of every draft path.

A draft token's conv output and recurrent state must be what running its path (root .. parent .. itself) on top of
the committed state gives, for chains (NEXTN, topk 1) and trees (NGRAM, EAGLE topk > 1); the committed slots stay
untouched, so a rejected draft leaves nothing behind."""

import pytest
import torch

from helpers import rel_err
from sglang_cpu_compat.ops.spec_verify import (causal_conv1d_verify, draft_parents, recurrent_gated_delta_rule_verify,
                                                recurrent_kda_verify)
from tailreplay_sglang.ops import gdn, naive
from tailreplay_sglang.ops.kda import kda_gate

TOL = 1e-5
# A tree of 6 draft tokens: 0 -> (1, 2), 1 -> 3, 2 -> (4, 5). First child / next sibling, as EAGLE packs it.
TREE_NEXT = [1, 3, 4, -1, -1, -1]
TREE_SIBLING = [-1, 2, -1, -1, 5, -1]
TREE_PARENTS = [0, 0, 0, 1, 2, 2]


def _path(token: int, parents: list[int]) -> list[int]:
    path = [token]
    while path[-1] > 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _shape(batch, steps, tree):
    if not tree:
        return None, None, [list(range(steps))[: i + 1] for i in range(steps)], [max(i - 1, 0) for i in range(steps)]
    next_token = torch.tensor([TREE_NEXT] * batch)
    next_sibling = torch.tensor([TREE_SIBLING] * batch)
    return next_token, next_sibling, [_path(i, TREE_PARENTS) for i in range(steps)], TREE_PARENTS


def test_draft_parents_from_first_child_and_sibling_lists():
    parents = draft_parents(torch.tensor([TREE_NEXT]), torch.tensor([TREE_SIBLING]))
    assert parents[0].tolist() == TREE_PARENTS


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("width", [2, 4])
def test_conv_verify_windows_follow_each_draft_path(tree, width):
    torch.manual_seed(0)
    batch, dim, steps = 3, 8, 6
    next_token, next_sibling, paths, _ = _shape(batch, steps, tree)
    x = torch.randn(batch, dim, steps)
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    conv_states = torch.randn(5, dim, width - 1)
    committed = conv_states.clone()
    slots, inter_slots = torch.tensor([4, 0, 2]), torch.tensor([1, 0, 2])
    windows = torch.zeros(3, steps, dim, width - 1)
    parent_out = torch.full((batch, steps), -7)
    y = causal_conv1d_verify(x, conv_states, weight, bias, "silu", slots, windows, inter_slots, next_token,
                             next_sibling, parent_out if tree else None)
    for seq in range(batch):
        for step, path in enumerate(paths):
            ref_y, ref_window = naive.naive_causal_conv1d(x[seq][:, path].double(), weight.double(), bias.double(),
                                                          committed[slots[seq]].double())
            assert rel_err(y[seq, :, step], ref_y[:, -1]) < TOL
            assert rel_err(windows[inter_slots[seq], step], ref_window) < TOL
        # the slot shifts by the draft (as the Triton kernel); the commit then writes the accepted step's window
        expected = torch.cat([committed[slots[seq]], x[seq]], -1)[:, -(width - 1):]
        assert torch.equal(conv_states[slots[seq]], expected)
    assert torch.equal(conv_states[[1, 3]], committed[[1, 3]])
    if tree:
        assert parent_out.tolist() == [TREE_PARENTS] * batch


@pytest.mark.parametrize("tree", [False, True])
def test_recurrent_verify_states_follow_each_draft_path_and_leave_the_slots(tree):
    torch.manual_seed(1)
    batch, steps, H, HV, K, V = 2, 6, 2, 4, 8, 8
    _, _, paths, parents = _shape(batch, steps, tree)
    n = batch * steps
    q, k = torch.randn(1, n, H, K), torch.randn(1, n, H, K)
    v, a, b = torch.randn(1, n, HV, V), torch.randn(n, HV), torch.randn(n, HV)
    A_log, dt_bias = torch.randn(HV) * 0.5, torch.randn(HV)
    pool = torch.randn(4, HV, V, K) * 0.1
    committed = pool.clone()
    slots, inter_slots = torch.tensor([3, 1]), torch.tensor([1, 0])
    buffer = torch.zeros(2, steps, HV, V, K)
    cu = torch.arange(0, n + 1, steps)
    parent_index = torch.tensor([parents] * batch) if tree else None
    o = recurrent_gated_delta_rule_verify(A_log, dt_bias, q, k, v, a, b, pool, slots, cu, buffer, inter_slots,
                                          parent_index, disable_state_update=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(pool, committed)
    g, beta = gdn.gdn_gating(A_log, a, b, dt_bias)
    expand = lambda x: x[0].repeat_interleave(HV // H, dim=1).double()  # noqa: E731
    qe, ke = expand(gdn.l2norm(q.double())), expand(gdn.l2norm(k.double()))
    for seq in range(batch):
        for step, path in enumerate(paths):
            rows = [seq * steps + i for i in path]
            ref_o, ref_state = naive.naive_recurrent_gated_delta_rule(
                qe[rows], ke[rows], v[0, rows].double(), g[0, rows].double(), beta[0, rows].double(),
                committed[slots[seq]].double(), scale=K**-0.5)
            assert rel_err(o[0, rows[-1]], ref_o[-1]) < TOL
            assert rel_err(buffer[inter_slots[seq], step], ref_state) < TOL


@pytest.mark.parametrize("tree", [False, True])
def test_kda_verify_states_follow_each_draft_path_and_leave_the_slots(tree):
    """KDA's verify (Ling-3.0's MTP draft): the per-key-channel decay of each draft path's own gates, against the
    float64 KDA recurrence from the committed state."""
    torch.manual_seed(3)
    batch, steps, HV, K, V = 2, 6, 4, 8, 8
    _, _, paths, parents = _shape(batch, steps, tree)
    n = batch * steps
    q, k, v = torch.randn(1, n, HV, K), torch.randn(1, n, HV, K), torch.randn(1, n, HV, V)
    a, b = torch.randn(n, HV * K), torch.randn(n, HV)
    A_log, dt_bias = torch.randn(HV) * 0.5, torch.randn(HV * K)
    pool = torch.randn(4, HV, V, K) * 0.1
    committed = pool.clone()
    slots, inter_slots = torch.tensor([3, 1]), torch.tensor([1, 0])
    buffer = torch.zeros(2, steps, HV, V, K)
    o = recurrent_kda_verify(A_log, dt_bias, q, k, v, a, b, pool, slots, torch.arange(0, n + 1, steps), buffer,
                             inter_slots, torch.tensor([parents] * batch) if tree else None,
                             use_qk_l2norm_in_kernel=True, lower_bound=-5.0)
    assert torch.equal(pool, committed)
    g = kda_gate(a.double().reshape(n, HV, K), A_log.double(), dt_bias.double(), -5.0)
    for seq in range(batch):
        for step, path in enumerate(paths):
            rows = [seq * steps + i for i in path]
            ref_o, ref_state = naive.naive_recurrent_kda(
                q[0, rows].double(), k[0, rows].double(), v[0, rows].double(), g[rows], b[rows].double().sigmoid(),
                committed[slots[seq]].double(), use_qk_l2norm=True)
            assert rel_err(o[0, rows[-1]], ref_o[-1]) < TOL
            assert rel_err(buffer[inter_slots[seq], step], ref_state) < TOL


def test_recurrent_verify_with_state_update_commits_the_last_step():
    torch.manual_seed(2)
    n, H, HV, K, V = 4, 1, 2, 4, 4
    args = (torch.randn(HV), torch.randn(HV), torch.randn(1, n, H, K), torch.randn(1, n, H, K),
            torch.randn(1, n, HV, V), torch.randn(n, HV), torch.randn(n, HV))
    pool, buffer = torch.zeros(2, HV, V, K), torch.zeros(1, n, HV, V, K)
    recurrent_gated_delta_rule_verify(*args, pool, torch.tensor([1]), torch.tensor([0, n]), buffer, torch.tensor([0]),
                                      disable_state_update=False)
    assert torch.equal(pool[1], buffer[0, -1]) and pool[0].abs().sum() == 0
