"""Extend attention for SGLang's `torch_native` backend that computes only the new tokens' queries.

SGLang 0.5.23's `TorchNativeAttnBackend._run_sdpa_forward_extend` pads each request's queries to the whole sequence
(`per_req_query_redudant`, prefix rows left uninitialised) and runs causal SDPA over all L x L positions, keeping
only the suffix rows. So a 32-token suffix after a 16K cached prefix pays a full prefill's attention, and every cache
hit on CPU inherits that floor (docs/results.md has the stock hit's time).

Here each request's E new queries attend its L = prefix + E keys with a bottom-right-aligned causal mask (query i
sees keys 0 .. prefix + i), O(E x L) instead of O(L x L). Cross-attention, encoder inputs and sliding windows keep
SGLang's own path.
"""

import torch
from torch.nn.functional import scaled_dot_product_attention


def suffix_causal_mask(prefix_len: int, extend_len: int, device) -> torch.Tensor:
    """[E, L] bool, True where query i (absolute position prefix_len + i) may attend key j."""
    keys = torch.arange(prefix_len + extend_len, device=device)
    queries = torch.arange(extend_len, device=device) + prefix_len
    return keys[None, :] <= queries[:, None]


def sdpa_forward_extend(original, backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
                        causal=False, is_cross_attn=False, sliding_window_size=None):
    """AROUND hook on TorchNativeAttnBackend._run_sdpa_forward_extend (same arguments, same output)."""
    if not causal or encoder_lens is not None or is_cross_attn or sliding_window_size is not None:
        return original(backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                        causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
    query = query.movedim(0, -2)  # [tokens, heads, dim] -> [heads, tokens, dim]
    start_q = 0
    for seq_idx in range(seq_lens.shape[0]):
        extend, prefix, total = int(extend_seq_lens[seq_idx]), int(extend_prefix_lens[seq_idx]), int(seq_lens[seq_idx])
        q = query[:, start_q:start_q + extend, :]
        slots = req_to_token[req_pool_indices[seq_idx], :total]
        k = k_cache[slots].movedim(0, -2).to(q.dtype)
        v = v_cache[slots].movedim(0, -2).to(q.dtype)
        # A fresh prompt is square, where SDPA's own causal flag is the right mask and needs no [E, L] tensor.
        mask = None if prefix == 0 else suffix_causal_mask(prefix, extend, q.device)
        out = scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                           is_causal=prefix == 0, scale=scaling, enable_gqa=enable_gqa)
        output[start_q:start_q + extend] = out.squeeze(0).movedim(-2, 0)
        start_q += extend
    return output
