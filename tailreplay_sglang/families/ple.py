"""Qwen3.8-Flash-Next's per-layer embeddings (PLE) in a replay: the layer's contribution over a tail, and the two
per-request states it keeps, rebuilt from the hidden store.

A PLE layer (`models/qwen4_exp.py` `Qwen4ExpPLELayer.forward`) adds `P = G + silu(conv(norm_conv(G)))` to the streams
X entering it, where `G = sigmoid(gate(norm_key(key_proj(E)), norm_query(X))) * value_proj(E)` per stream and E is
the hashed n-gram embedding of the token and its `ngram_size - 1` predecessors (EOS before the sequence). The conv is
depthwise with dilation `ngram_size`; its state is the last `(kernel - 1) x ngram_size` rows of `norm_conv(G)` (zeros
on a fresh slot), and the request also keeps its last `ngram_size - 1` token ids (EOS on a fresh slot).

Every PLE layer starts a group (`layout.ple_layers`), so X is a stored group input. Over a span of rows the state
before it is exactly the `norm_conv(G)` of the span's own first rows once the span starts that many rows early:
`ple_over` runs the conv from zeros over [start - window, end), which gives the tail's P (the group replay) and the
state at the match end (`write_states`, on every hit: an interval anchor's slot holds GDN states only, and a cleared
slot none). The math is SGLang's non-fused path, on the layer's own modules.
"""

import math

import torch
import torch.nn.functional as F


# What the replay reads of a PLE layer (`Family.required`): SGLang's own modules and n-gram hash
REQUIRED = tuple(f"ple.{p}" for p in (
    "ple_embedding._hash_contexts", "ple_embedding._embed_ngram_ids", "ple_embedding.ngram_size",
    "ple_embedding.eos_token_id", "key_proj", "value_proj", "norm_key", "norm_query", "norm_conv", "_apply_ple_norm",
    "conv1d.weight", "short_conv_dilation", "short_conv_state_len", "conv_channels", "hc_count", "hidden_size",
    "layer_id"))


def window(ple) -> int:
    """Rows before a position that its conv state holds."""
    return ple.short_conv_state_len


def ple_over(ple, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's span: x [L, hc x hidden] the streams entering the layer, ids [L + ngram_size - 1] the span's
    token ids with their predecessors (EOS before the sequence). Returns P [L, hc x hidden] and the conv state
    after the span [hc x hidden, window] (exact where the span starts `window` rows early or at position 0)."""
    embedding = ple.ple_embedding
    contexts = ids.unfold(0, embedding.ngram_size, 1)
    e = embedding._embed_ngram_ids(embedding._hash_contexts(contexts), None, x.shape[0]).flatten(start_dim=-2)
    key, _ = ple.key_proj(e)
    value, _ = ple.value_proj(e)
    hc, hidden = ple.hc_count, ple.hidden_size
    key_normed = ple._apply_ple_norm(ple.norm_key, key.reshape(-1, hc, hidden))
    query_normed = ple._apply_ple_norm(ple.norm_query, x.reshape(-1, hc, hidden))
    gate = (key_normed * query_normed).sum(dim=-1, keepdim=True) / math.sqrt(hidden)
    gate = torch.sigmoid(gate.abs().clamp_min(1e-6).sqrt() * gate.sign())
    gated = gate * value.unsqueeze(-2)
    normed = ple._apply_ple_norm(ple.norm_conv, gated).flatten(-2)
    conv_input = torch.cat([normed.new_zeros(window(ple), normed.shape[1]), normed]).t().unsqueeze(0)
    conv = F.conv1d(conv_input, ple.conv1d.weight.to(dtype=x.dtype), dilation=ple.short_conv_dilation,
                    groups=ple.conv_channels)[0].t()
    return gated.flatten(-2) + F.silu(conv), conv_input[0, :, -window(ple):]


def span_ids(store, pool_row_tokens: torch.Tensor, start: int, end: int, context: int, eos: int) -> torch.Tensor:
    """Token ids of positions [start - context, end) of one sequence, from the store; EOS before position 0."""
    first = max(0, start - context)
    ids = store.read_tokens(pool_row_tokens[first:end].long()).to(pool_row_tokens.device)
    return torch.cat([ids.new_full((first - (start - context),), eos), ids])


def write_states(ple, pool, slot: int, state: torch.Tensor) -> None:
    cache = pool.short_conv_layer_cache(ple.layer_id)
    cache[slot] = state.to(cache.dtype)

