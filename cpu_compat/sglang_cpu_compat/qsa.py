"""Qwen3.8-Flash-Next's QSA indexer (`QSAIndexer`, the sparse-attention layers' block selection) on a CPU."""


def indexer_forward_native(self, hidden_states, positions, forward_batch, indexer_metadata,
                           cp_global_rope_positions=None):
    """REPLACE `QSAIndexer.forward_native`: SGLang 0.5.23 defines the indexer's forward for CUDA and XPU only, and a CPU
    dispatch reaches the base class's `forward_native`, which raises NotImplementedError. Both defined ones call
    `_forward_impl`, the "portable orchestration" whose every kernel has its torch branch behind a device check (the
    scoring `qsa_mqa_*`, `qsa_fast_topk`, `expand_qsa_block_indices`, the un-fused norm, RoPE and compression)."""
    return self._forward_impl(hidden_states, positions, forward_batch, indexer_metadata, cp_global_rope_positions)


def gather_compressed_keys(compressed, token_slot_table, cu_blocks, total_blocks: int, max_blocks: int,
                           compress_ratio: int):
    """REPLACE `qsa.metadata.gather_qsa_compressed_keys` (a Triton kernel): every sequence's complete compressed
    keys, packed in sequence order; block b of sequence i is the compressed row of its first token's KV slot
    (slot // ratio: the allocator is page-aligned, so a block never straddles a page)."""
    import torch

    output = compressed.new_empty((total_blocks, *compressed.shape[1:]))
    for i in range(cu_blocks.shape[0] - 1):
        start, end = int(cu_blocks[i]), int(cu_blocks[i + 1])
        first = token_slot_table[i, torch.arange(end - start, device=compressed.device) * compress_ratio].long()
        output[start:end] = compressed[first // compress_ratio]
    return output
