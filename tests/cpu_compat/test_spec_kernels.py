"""The speculative-decoding bookkeeping ops the CPU port serves as `sgl_kernel.*_cpu`, on hand-built chains and trees
(what SGLang's Triton kernels compute for the same inputs, worked out by hand)."""

import torch

from sglang_cpu_compat.sgl_kernel_shim import copy_all_layer_kv_cache_cpu
from sglang_cpu_compat.spec_kernels import (assign_draft_cache_locs_contiguous_cpu, assign_extend_cache_locs_cpu,
                                            assign_req_to_token_pool_cpu, build_tree_kernel_efficient_cpu,
                                            fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu,
                                            reconstruct_indices_from_tree_mask, verify_tree_greedy_cpu)

QLEN_ONLY = 1
# 0 -> (1, 2), 1 -> 3, 2 -> (4, 5), as in test_spec_verify.py
TREE_NEXT = [1, 3, 4, -1, -1, -1]
TREE_SIBLING = [-1, 2, -1, -1, 5, -1]
TREE_ANCESTORS = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 2, 5]]  # each node and its ancestors


def test_req_to_token_assignments_round_trip():
    req_to_token = torch.zeros(4, 16, dtype=torch.int64)
    pools, starts, ends = torch.tensor([2, 0]), torch.tensor([3, 5]), torch.tensor([5, 8])
    locs = torch.tensor([10, 11, 20, 21, 22])
    assign_req_to_token_pool_cpu(pools, req_to_token, starts, ends, locs, 16)
    assert req_to_token[2, 3:5].tolist() == [10, 11] and req_to_token[0, 5:8].tolist() == [20, 21, 22]
    back = torch.zeros(5, dtype=torch.int64)
    assign_extend_cache_locs_cpu(pools, req_to_token, starts, ends, back, 16)
    assert torch.equal(back, locs)
    drafts = torch.zeros(4, dtype=torch.int64)  # topk 1 x 2 steps per request, from seq_lens on
    assign_draft_cache_locs_contiguous_cpu(pools, req_to_token, torch.tensor([3, 5]), drafts, 16, 1, 2)
    assert drafts.tolist() == [10, 11, 20, 21]


def test_bonus_tokens_and_accepted_slots():
    accept_tokens = torch.tensor([[7, 8, 9], [4, 5, 6]])
    bonus = torch.zeros(2, dtype=torch.int64)
    fill_bonus_tokens_cpu(accept_tokens, torch.tensor([2, 3]), bonus, 3)
    assert bonus.tolist() == [8, 6]
    packed = torch.full((5,), -1)
    fill_accept_out_cache_loc_cpu(torch.tensor([[0, 1, -1], [4, -1, -1]]), torch.arange(100, 108), packed)
    assert packed[:3].tolist() == [100, 101, 104]


def test_chain_tree_and_greedy_verify():
    """topk 1, 3 draft steps (4 verify tokens): a chain, positions seq_len + depth, a lower-triangular mask."""
    steps, T = 3, 4
    parents, selected = torch.tensor([[-1, 0, 1, 2]]), torch.tensor([[0, 1, 2]])  # draft step i's token is i
    mask = torch.ones(T * T, dtype=torch.bool)
    positions = torch.zeros(T, dtype=torch.int64)
    index, next_token, sibling = (torch.full((1, T), -1, dtype=torch.int64) for _ in range(3))
    build_tree_kernel_efficient_cpu(parents, selected, torch.tensor([10]), mask, positions, index, next_token,
                                    sibling, 1, steps, T, QLEN_ONLY)
    assert next_token[0].tolist() == [1, 2, 3, -1] and sibling[0].tolist() == [-1] * T
    assert positions.tolist() == [10, 11, 12, 13] and index[0].tolist() == [0, 1, 2, 3]
    assert torch.equal(mask.view(T, T), torch.ones(T, T, dtype=torch.bool).tril())
    # the target agrees with drafts 1 and 2, not 3: two accepted, the bonus token is the target's at node 2
    candidates = torch.tensor([[5, 6, 7, 8]])
    target = torch.tensor([[6, 7, 9, 1]])
    predicts = torch.full((T,), -1)
    accept_index = torch.full((1, T), -1)
    accepted = torch.zeros(1, dtype=torch.int64)
    verify_tree_greedy_cpu(predicts, accept_index, accepted, candidates, index, next_token, sibling, target)
    assert accepted.tolist() == [2] and accept_index[0].tolist() == [0, 1, 2, -1]
    assert predicts[:3].tolist() == [6, 7, 9]


def test_tree_from_ancestor_mask_and_greedy_verify_picks_the_matching_branch():
    n = 6
    mask = torch.zeros(1, n, n, dtype=torch.bool)
    for node, ancestors in enumerate(TREE_ANCESTORS):
        mask[0, node, ancestors] = True
    positions, index, next_token, sibling = (torch.zeros(1, n, dtype=torch.int64) for _ in range(4))
    reconstruct_indices_from_tree_mask(mask, torch.tensor([20]), positions.view(-1), index, next_token, sibling, 1, n)
    assert next_token[0].tolist() == TREE_NEXT and sibling[0].tolist() == TREE_SIBLING
    assert positions[0].tolist() == [20, 21, 21, 22, 22, 22] and index[0].tolist() == list(range(n))
    # candidates: node 2 (the second child) matches the root's prediction, then node 5 (its second child)
    candidates = torch.tensor([[0, 11, 12, 13, 14, 15]])
    target = torch.tensor([[12, 0, 15, 0, 0, 3]])
    predicts, accept_index = torch.full((n,), -1), torch.full((1, 4), -1)
    accepted = torch.zeros(1, dtype=torch.int64)
    verify_tree_greedy_cpu(predicts, accept_index, accepted, candidates, index, next_token, sibling, target)
    assert accepted.tolist() == [2] and accept_index[0].tolist() == [0, 2, 5, -1]
    assert predicts[[0, 2, 5]].tolist() == [12, 15, 3]


def test_kv_rows_move_in_every_layer_reading_before_writing():
    layers = [torch.arange(24, dtype=torch.float32).view(6, 4), torch.arange(12, dtype=torch.int16).view(6, 2)]
    before = [t.clone() for t in layers]
    pointers = torch.tensor([t.data_ptr() for t in layers])
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers])
    copy_all_layer_kv_cache_cpu(pointers, strides, torch.tensor([1, 2]), torch.tensor([2, 4]))  # 2 -> 1, 4 -> 2
    for layer, old in zip(layers, before):
        assert torch.equal(layer[1], old[2]) and torch.equal(layer[2], old[4]) and torch.equal(layer[0], old[0])
