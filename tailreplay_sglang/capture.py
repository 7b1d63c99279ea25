"""Writes replay inputs into the hidden store during every forward (prefill, chunked prefill, decode).

Forward pre-hooks on GDN layers' `linear_attn` modules: SGLang calls `linear_attn(hidden_states, forward_batch)`
right after the layer's fused add + RMSNorm, when `forward_batch.residual_stream.residual` holds the
residual-stream value entering the layer, for the tokens at `forward_batch.out_cache_loc`.

Models whose decoder layers carry the whole residual stream in `hidden_states` (no split residual; OLMo-Hybrid in
`tailreplay_sglang.models`, marked `carries_stream_in_hidden_states`) are hooked on the decoder layer instead,
`layer(positions, hidden_states, forward_batch)`: its input is the value entering the group. With OLMo-Hybrid's
post-norm attention layers that is the FA layer's output, norms included, the same quantity as for Qwen3.5.

Mamba2 models' layers begin with SGLang's stage boundary, `prepare(hidden_states, forward_batch)` (fused add +
norm), which leaves the value entering the layer in `forward_batch.residual_stream.residual`; Nemotron-H's layers
are called through `.forward` (no module hooks fire). That call is wrapped on the group's first layer instead:
`layer.boundary` on Nemotron-H, `layer.attn_boundary` on Granite-4.0-H.
"""

from functools import partial

from tailreplay_sglang.store.hidden_store import HiddenStore


def _capture_tokens(store: HiddenStore, module, args):
    forward_batch = args[1]
    if forward_batch.out_cache_loc is not None and forward_batch.input_ids is not None:
        n = forward_batch.out_cache_loc.shape[0]
        store.write_tokens(forward_batch.out_cache_loc, forward_batch.input_ids[:n])


def _capture_group_input(store: HiddenStore, first_layer: int, module, args):
    forward_batch = args[1]
    stream = getattr(forward_batch, "residual_stream", None)
    if stream is None or stream.residual is None or forward_batch.out_cache_loc is None:
        return
    n = forward_batch.out_cache_loc.shape[0]
    store.write_hidden(first_layer, forward_batch.out_cache_loc, stream.residual[:n])


def _capture_layer_input(store: HiddenStore, first_layer: int, module, args):
    hidden_states, forward_batch = args[1], args[2]
    if forward_batch.out_cache_loc is None:
        return
    n = forward_batch.out_cache_loc.shape[0]
    store.write_hidden(first_layer, forward_batch.out_cache_loc, hidden_states[:n])


BOUNDARIES = ("boundary", "attn_boundary")  # the stage boundary a layer begins with: Nemotron-H's, Granite-4.0-H's


def _entry_boundary(layer):
    return next((getattr(layer, name) for name in BOUNDARIES if hasattr(layer, name)), None)


class _StageInputCapture:
    """Wraps one layer's entry `prepare` (Mamba2 models): after it, writes the tokens or the group input."""

    def __init__(self, layer, store: HiddenStore, first_layer: int | None):
        self.boundary = _entry_boundary(layer)
        self.prepare = self.boundary.prepare
        self.store, self.first_layer = store, first_layer
        self.boundary.prepare = self

    def __call__(self, hidden_states, forward_batch, **kwargs):
        out = self.prepare(hidden_states, forward_batch, **kwargs)
        if forward_batch.out_cache_loc is not None:
            n = forward_batch.out_cache_loc.shape[0]
            if self.first_layer is None:
                if forward_batch.input_ids is not None:
                    self.store.write_tokens(forward_batch.out_cache_loc, forward_batch.input_ids[:n])
            else:
                stream = forward_batch.residual_stream
                self.store.write_hidden(self.first_layer, forward_batch.out_cache_loc, stream.residual[:n])
        return out

    def remove(self) -> None:
        self.boundary.prepare = self.prepare


def install(layers, store: HiddenStore) -> list:
    """Register the hooks on the model's decoder layers; returns the handles."""
    groups = store.layout.groups
    if _entry_boundary(layers[groups[0].first_layer]) is not None:  # Mamba2 models
        return [_StageInputCapture(layers[groups[0].first_layer], store, None)] + [
            _StageInputCapture(layers[g.first_layer], store, g.first_layer) for g in store.layout.stored_groups]
    handles = [layers[groups[0].first_layer].linear_attn.register_forward_pre_hook(partial(_capture_tokens, store))]
    for group in store.layout.stored_groups:
        layer = layers[group.first_layer]
        if getattr(layer, "carries_stream_in_hidden_states", False):
            handles.append(layer.register_forward_pre_hook(partial(_capture_layer_input, store, group.first_layer)))
        else:
            hook = partial(_capture_group_input, store, group.first_layer)
            handles.append(layer.linear_attn.register_forward_pre_hook(hook))
    return handles
