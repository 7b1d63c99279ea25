"""Gated DeltaNet under hyper-connections (Qwen3.8-Flash-Next, `Qwen4ExpForConditionalGeneration`).

The residual stream is `hc_count` streams, [T, hc x hidden]. Each layer reads its mixer's input and its MLP's input
through a gated residual (`attn_hyper_connection` / `mlp_hyper_connection`, SGLang's `GatedResidual`): `mix` is a
low-rank gated mean of the per-stream-normed streams; `combine` adds the block's output to every stream with that
stream's own weight, computed from the same normed streams. The streams part after the first `combine`, so a group's
input is all of them: the store keeps hc x hidden values per token and group (`HybridLayout.streams`). The layers
have no input norm (SGLang deletes them). A layer's replay is `mix` -> SGLang's GDN projections -> the plugin's GDN
kernel (`families.gdn.gdn_inputs`, `replay_gdn_layer`) -> `combine`, then `mix` -> MLP / MoE -> `combine`, through
the layer's own modules; the group's last layer computes only its states.

Capture: each stored group's first decoder layer's keyword `hidden_states`, the streams as they enter the layer. At
layer 0 that is the embedding [T, hidden], which the model widens into hc copies: the store keeps the copies (group
0 of a vision-language checkpoint), so every row has one width; group 0 of a text replay re-embeds and widens.

Per-layer embeddings (PLE: a hashed n-gram embedding and a dilated short conv on `ple_layer_ids`): every PLE layer
starts a group (`layout.ple_layers`), so the streams entering it are stored. A PLE group's replay adds the layer's
contribution over the tail, computed from the stored rows of the tail and of the conv's window before it
(`families/ple.py`); after every hit, replayed or not, each PLE layer's conv state and the n-gram history at the match
end are rebuilt the same way (`on_hits`).
"""

import torch

from tailreplay_sglang import capture
from tailreplay_sglang.architectures import decoder_stack
from tailreplay_sglang.families import ple as ple_ops
from tailreplay_sglang.families.base import ReplayBatch, replayed_layer_requirements, token_embedding
from tailreplay_sglang.families.gdn import GdnFamily, gdn_inputs
from tailreplay_sglang.kernels.replay import replay_gdn_layer
from tailreplay_sglang.ops.gdn import gdn_gating

_MIXER = ("linear_attn._forward_input_proj", "linear_attn.fix_query_key_value_ordering", "linear_attn.head_v_dim",
          "linear_attn.norm", "linear_attn.out_proj", "linear_attn.attn.conv_weights", "linear_attn.attn.bias",
          "linear_attn.A_log", "linear_attn.dt_bias", "attn_hyper_connection.mix", "attn_hyper_connection.combine")
_FEED_FORWARD = ("mlp", "mlp_hyper_connection.mix", "mlp_hyper_connection.combine")


class HyperGdnFamily(GdnFamily):
    name = "gdn_hc"
    dp_attention = False  # not tested on this family
    speculative = True  # Qwen3.8-Flash-Next's MTP head

    def install_capture(self, model, store) -> list:
        return capture.at_layer_keyword_inputs(model.layers, store)

    def group_input(self, model, group, x: torch.Tensor) -> torch.Tensor:
        hyper = model.layers[group.first_layer].attn_hyper_connection
        return capture.widened(x, hyper.hc_count, hyper.hidden_size)

    def replay_group(self, model, pool, group, x: torch.Tensor, batch: ReplayBatch) -> None:
        x = self.group_input(model, group, x)
        ple = getattr(model.layers[group.first_layer], "ple", None)
        if ple is not None:
            x = x + self._ple_over_tails(model, pool, group, ple, x, batch)
        for i, layer_id in enumerate(group.recurrent_layers):
            last = i == len(group.recurrent_layers) - 1
            x = self.replay_layer(model.layers[layer_id], pool.mamba2_layer_cache(layer_id), x, batch, state_only=last)

    def _ple_over_tails(self, model, pool, group, ple, x: torch.Tensor, batch: ReplayBatch) -> torch.Tensor:
        """The PLE layer's contribution over each tail, its conv run from the window of stored rows before it."""
        out, cu = torch.empty_like(x), batch.cu_seqlens_cpu.tolist()
        for i, (start, row) in enumerate(zip(batch.tail_starts, batch.pool_rows)):
            span = self._span(model, pool, group, ple, batch.store, row, start, start + batch.tail_lens[i],
                              x[cu[i]:cu[i + 1]])
            out[cu[i]:cu[i + 1]] = span[0][-batch.tail_lens[i]:]
        return out

    @torch.no_grad()
    def on_hits(self, runner, store, hits: list[tuple[int, int]]) -> None:
        """Each PLE layer's conv state and the n-gram history at every hit's match end, into its slot."""
        model, pool = decoder_stack(runner.model), runner.req_to_token_pool
        layers = [g for g in store.layout.groups if getattr(model.layers[g.first_layer], "ple", None) is not None]
        if not layers or not hits:
            return
        device = pool.req_to_token.device
        slots = pool.get_mamba_indices(torch.tensor([row for row, _ in hits], device=device)).long()
        embedding = model.layers[layers[0].first_layer].ple.ple_embedding  # one history, shared by the layers
        histories = []
        for (row, end), slot in zip(hits, slots.tolist()):
            for group in layers:
                ple = model.layers[group.first_layer].ple
                state = self._span(model, pool, group, ple, store, row, end, end, None)[1]
                ple_ops.write_states(ple, pool, slot, state)
            histories.append(ple_ops.span_ids(store, pool.req_to_token[row], end, end, embedding.ngram_size - 1,
                                              embedding.eos_token_id))
        pool.set_ngram_context(slots, torch.stack(histories))

    def _span(self, model, pool, group, ple, store, row: int, start: int, end: int, tail):
        """`ple_ops.ple_over` on one sequence's positions [start - window, end): the window's rows from the store,
        then `tail` (the replayed rows of [start, end), or None where start == end)."""
        first = max(0, start - ple_ops.window(ple))
        tokens = pool.req_to_token[row]
        dtype = token_embedding(model).weight.dtype
        slots = tokens[first:start].long()
        if store.is_stored(group.first_layer):
            before = store.decode(store.read_hidden(group.first_layer, slots).to(slots.device), dtype)
        else:  # group 0 of a text checkpoint: the embeddings of the window's ids
            before = token_embedding(model)(store.read_tokens(slots).to(slots.device))
        x = self.group_input(model, group, before)
        if tail is not None:
            x = torch.cat([x, tail])
        context = ple.ple_embedding.ngram_size - 1
        ids = ple_ops.span_ids(store, tokens, first, end, context, ple.ple_embedding.eos_token_id)
        return ple_ops.ple_over(ple, x, ids)

    def replay_layer(self, layer, cache, x: torch.Tensor, batch: ReplayBatch, state_only: bool):
        return replay_layer(layer, cache, x, batch, state_only)

    def required(self, model, layout) -> list:
        def paths(layer_id):
            return _MIXER + (ple_ops.REQUIRED if layer_id in layout.group_starts else ())
        return replayed_layer_requirements(model, layout, paths, _FEED_FORWARD)


def replay_layer(layer, cache, x: torch.Tensor, batch: ReplayBatch, state_only: bool):
    """One GDN decoder layer over the packed tails' streams x [T, hc x hidden]; conv and recurrent states land in the
    requests' slots. Returns the streams leaving the layer, or None when only the states were needed."""
    la = layer.linear_attn
    h, residuals = layer.attn_hyper_connection.mix(x)
    mixed, a, b, output = gdn_inputs(la, h)
    g, _ = gdn_gating(la.A_log, a, b, la.dt_bias)
    batch.observe_decay(g[0])
    core = replay_gdn_layer(mixed, a, b, la.attn.conv_weights, la.attn.bias, la.A_log, la.dt_bias, batch.cu_seqlens,
                            batch.mamba_slots, cache.conv[0], cache.temporal, state_only=state_only,
                            max_seqlen=max(batch.tail_lens), cu_seqlens_cpu=batch.cu_seqlens_cpu)
    if state_only:
        return None
    x = layer.attn_hyper_connection.combine(output(core), residuals)
    h, residuals = layer.mlp_hyper_connection.mix(x)
    return layer.mlp_hyper_connection.combine(batch.feed_forward(layer.mlp, h), residuals)


FAMILY = HyperGdnFamily()
