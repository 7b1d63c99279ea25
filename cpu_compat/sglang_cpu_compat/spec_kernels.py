"""The speculative-decoding bookkeeping kernels SGLang takes from sgl_kernel's CPU build (`*_cpu`), in Python.

Each is the CPU twin of a Triton kernel in SGLang 0.5.23 and follows it line for line (one loop iteration per Triton
program): `mem_cache/allocation.py::assign_req_to_token_pool`, `kernels/ops/speculative/eagle.py::fill_bonus_tokens`
and `fill_accept_out_cache_loc`, `kernels/ops/speculative/spec_tree.py::sgl_build_tree_kernel_efficient_triton` and
`verify_tree_greedy_kernel_triton`. They move a few integers per request, so plain loops cost nothing next to a
forward. `tests/cpu_compat/test_spec_kernels.py` checks them against hand-built trees.
"""

from __future__ import annotations

import torch

FULL_MASK = 0  # TreeMaskMode.FULL_MASK; the other modes lay the mask out per request as [T, T]


def _packed_spans(req_pool_indices, start_offset, end_offset):
    """(request row, start, end, packed slice) per request: request b's span start..end of its row, and where its
    entries sit in a batch-ordered packed array."""
    offset = 0
    for b in range(req_pool_indices.shape[0]):
        start, end = int(start_offset[b]), int(end_offset[b])
        yield int(req_pool_indices[b]), start, end, slice(offset, offset + end - start)
        offset += end - start


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len=None) -> None:
    """Request b's new tokens (out_cache_loc, packed in batch order) go to its row at start..end."""
    for row, start, end, packed in _packed_spans(req_pool_indices, start_offset, end_offset):
        req_to_token[row, start:end] = out_cache_loc[packed]


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len=None) -> None:
    """The reverse: request b's slots start..end, read from its row and packed into out_cache_loc."""
    for row, start, end, packed in _packed_spans(req_pool_indices, start_offset, end_offset):
        out_cache_loc[packed] = req_to_token[row, start:end]


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len,
                                           topk: int, speculative_num_steps: int) -> None:
    """Request b's topk * steps draft slots, the ones its row holds from seq_lens[b] on."""
    width = topk * speculative_num_steps
    for b in range(seq_lens.shape[0]):
        start = int(seq_lens[b])
        out_cache_loc[b * width : (b + 1) * width] = req_to_token[int(req_pool_indices[b]), start : start + width]


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride: int) -> None:
    """bonus_tokens[b] = request b's last accepted token (accept_lens counts the bonus token)."""
    flat = accept_tokens.reshape(-1)
    for b in range(accept_lens.shape[0]):
        bonus_tokens[b] = flat[accept_stride * b + int(accept_lens[b]) - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """The KV slots of the accepted draft tokens (accept_index >= 0), packed in order."""
    flat = accept_index.reshape(-1)
    kept = flat[flat > -1].long()
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept]


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrieve_index, retrieve_next_token, retrieve_next_sibling, topk: int,
                                    depth: int, draft_token_num: int, tree_mask_mode: int) -> None:
    """EAGLE's draft tree: first-child / next-sibling lists, positions and the verify attention mask."""
    T = draft_token_num
    seq_lens = verified_seq_len.tolist()
    prefix_sums = [sum(seq_lens[:b]) for b in range(len(seq_lens))]
    for b, seq_len in enumerate(seq_lens):
        selected, parents = selected_index[b].tolist(), parent_list[b].tolist()

        def position_of(token_index: int) -> int | None:
            """Where `token_index` (a draft-step token id) sits among this request's selected drafts."""
            return selected.index(token_index) if token_index in selected[: T - 1] else None

        positions[b * T] = seq_len
        for i in range(T - 1, 0, -1):
            retrieve_index[b, i] = b * T + i
            parent_tb = selected[i - 1] // topk
            parent_position = 0 if parent_tb == 0 else position_of(parents[parent_tb])
            if parent_position is None:
                continue
            parent_position += 0 if parent_tb == 0 else 1
            first_child = int(retrieve_next_token[b, parent_position])
            retrieve_next_token[b, parent_position] = i
            if first_child != -1:
                retrieve_next_sibling[b, i] = first_child
        retrieve_index[b, 0] = b * T
        for token in range(T):
            if tree_mask_mode == FULL_MASK:
                row = T * T * b + prefix_sums[b] * T + (seq_len + T) * token + seq_len
            else:
                row = T * T * b + T * token
            tree_mask[row : row + T] = False
            tree_mask[row] = True
            if token == 0:
                continue
            current, position = token - 1, 0
            for _ in range(depth):
                position += 1
                tree_mask[row + 1 + current] = True
                parent_tb = selected[current] // topk
                if parent_tb == 0:
                    break
                current = position_of(parents[parent_tb])
                if current is None:
                    break
            positions[b * T + token] = position + seq_len


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, target_predict) -> None:
    """Greedy verify: walk the tree from the root, at each level take the child whose draft equals the target's
    prediction at the last accepted node; stop at the first level with no such child."""
    batch, T = candidates.shape
    num_spec = accept_index.shape[1]
    flat_predict = target_predict.reshape(-1)
    for b in range(batch):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, current = 0, 0
        for j in range(1, num_spec):
            current = int(retrive_next_token[b, current])
            target = flat_predict[last]
            while current != -1 and candidates[b, current] != target:
                current = int(retrive_next_sibling[b, current])
            if current == -1:
                break
            predicts[last] = target
            accepted += 1
            last = int(retrive_index[b, current])
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = flat_predict[last]


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrieve_index, retrieve_next_token,
                                       retrieve_next_sibling, batch_size: int, draft_token_num: int) -> None:
    """NGRAM's verify metadata from its [bs, n, n] ancestor mask (`sgl_kernel.speculative`; semantics as
    `kernels/ops/speculative/reconstruct_tree.py` states them): depth-based positions, parent = nearest ancestor,
    first child and next sibling."""
    n = draft_token_num
    for b in range(batch_size):
        mask = tree_mask.reshape(-1)[b * n * n : (b + 1) * n * n].view(n, n).bool()
        ancestors = mask & torch.ones(n, n, dtype=torch.bool, device=mask.device).tril(-1)
        positions[b * n : (b + 1) * n] = ancestors.sum(1) + int(verified_seq_len[b])
        retrieve_index.view(-1)[b * n : (b + 1) * n] = torch.arange(b * n, (b + 1) * n)
        parent = [max((j for j in range(i) if ancestors[i, j]), default=-1) for i in range(n)]
        for tid in range(n):
            children = [k for k in range(tid + 1, n) if ancestors[k, tid]]
            siblings = [k for k in range(tid + 1, n) if parent[k] == parent[tid]] if parent[tid] >= 0 else []
            retrieve_next_token.view(-1)[b * n + tid] = children[0] if children else -1
            retrieve_next_sibling.view(-1)[b * n + tid] = siblings[0] if siblings else -1


FUNCTIONS = {f.__name__: f for f in (
    assign_req_to_token_pool_cpu, assign_extend_cache_locs_cpu, assign_draft_cache_locs_contiguous_cpu,
    fill_bonus_tokens_cpu, fill_accept_out_cache_loc_cpu, build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu)}


def gather_spec_extras(indices, topk_p_buf, topk_index_buf, output_tokens_buf, hidden_states_buf):
    """REPLACE of `kernels/ops/speculative/gather_spec_extras.py::gather_spec_extras` (a Triton gather the overlap
    scheduler runs to pick each request's draft inputs by row): the same rows by plain indexing."""
    rows = indices.long()
    hidden = hidden_states_buf[rows] if hidden_states_buf is not None else None
    return topk_p_buf[rows], topk_index_buf[rows], output_tokens_buf[rows], hidden
