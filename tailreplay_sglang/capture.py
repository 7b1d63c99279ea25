"""Writes replay inputs into the hidden store during every forward (prefill, chunked prefill, decode): the token ids
and, for each stored group, the residual-stream value entering the group's first layer. Each family chooses one of
the two capture points below (`Family.install_capture`).

- `at_mixer_inputs`: forward pre-hooks on the mixer module SGLang calls right after the layer's fused add + RMSNorm
  (`linear_attn(hidden_states, forward_batch)`), when `forward_batch.residual_stream.residual` holds the value
  entering the layer, for the tokens at `forward_batch.out_cache_loc`. Layers that carry the whole residual stream
  in `hidden_states` (no split residual, marked `carries_stream_in_hidden_states`) are hooked on the decoder layer
  instead, `layer(positions, hidden_states, forward_batch)`: its input is the value entering the group.
- `at_stage_boundaries`: models whose layers begin with SGLang's stage boundary, `prepare(hidden_states,
  forward_batch)` (fused add + norm, which leaves the value entering the layer in the residual stream), and are
  called through `.forward` (no module hooks fire): that `prepare` is wrapped on each group's first layer. Kimi K3,
  whose boundary mixes a bank of earlier rows into its read, stores the prefix that read formed (`rows_of`).
- `at_decoder_layer_inputs`: pre-hooks on decoder layers called `layer(positions, hidden_states, forward_batch)`
  whose `hidden_states` is the whole residual stream and whose mixer is called with keywords (Jet-Nemotron).
- `at_layer_keyword_inputs`: keyword pre-hooks on decoder layers the model calls with keywords only
  (`layer(layer_id=i, positions=..., hidden_states=..., residual=..., forward_batch=...)`, LFM2) and whose
  `hidden_states` is the whole residual stream entering the layer.
"""

from functools import partial

from tailreplay_sglang.store.hidden_store import HiddenStore


def write_rows(store: HiddenStore, first_layer: int | None, forward_batch, rows) -> None:
    """For the batch's new tokens (`out_cache_loc`): their ids (`first_layer` None: group 0's capture point) or
    `rows`, the input of the stored group that starts at `first_layer`."""
    loc = forward_batch.out_cache_loc
    if loc is None:
        return
    n = loc.shape[0]
    if first_layer is None:
        if forward_batch.input_ids is not None:
            store.write_tokens(loc, forward_batch.input_ids[:n])
    else:
        store.write_hidden(first_layer, loc, rows[:n])


def _capture_tokens(store: HiddenStore, module, args):
    write_rows(store, None, args[1], None)


def _capture_group_input(store: HiddenStore, first_layer: int, module, args):
    stream = getattr(args[1], "residual_stream", None)
    if stream is not None and stream.residual is not None:
        write_rows(store, first_layer, args[1], stream.residual)


def _capture_layer_input(store: HiddenStore, first_layer: int, module, args):
    write_rows(store, first_layer, args[2], args[1])  # layer(positions, hidden_states, forward_batch)


def _capture_layer_tokens(store: HiddenStore, module, args):
    write_rows(store, None, args[2], None)  # layer(positions, hidden_states, forward_batch)


def at_decoder_layer_inputs(layers, store: HiddenStore) -> list:
    """Pre-hooks on the decoder layers, for models whose layers carry the whole residual stream in `hidden_states`,
    are called positionally and call their mixer with keywords (Jet-Nemotron): the tokens on group 0's first layer,
    each stored group's input on its first layer; returns the handles."""
    first = store.layout.groups[0].first_layer
    handles = [layers[first].register_forward_pre_hook(partial(_capture_layer_tokens, store))]
    for group in store.layout.stored_groups:
        hook = partial(_capture_layer_input, store, group.first_layer)
        handles.append(layers[group.first_layer].register_forward_pre_hook(hook))
    return handles


def at_mixer_inputs(layers, store: HiddenStore, mixer: str) -> list:
    """Pre-hooks on each group's first `layer.<mixer>` (or the decoder layer); returns the handles."""
    first = store.layout.groups[0].first_layer
    handles = [getattr(layers[first], mixer).register_forward_pre_hook(partial(_capture_tokens, store))]
    for group in store.layout.stored_groups:
        layer = layers[group.first_layer]
        if getattr(layer, "carries_stream_in_hidden_states", False):
            handles.append(layer.register_forward_pre_hook(partial(_capture_layer_input, store, group.first_layer)))
        else:
            hook = partial(_capture_group_input, store, group.first_layer)
            handles.append(getattr(layer, mixer).register_forward_pre_hook(hook))
    return handles


def stream_residual(forward_batch):
    """The residual a stage boundary's `prepare` leaves in the batch's residual stream: the value entering the layer."""
    return forward_batch.residual_stream.residual


class _StageInputCapture:
    """Wraps one layer's entry `prepare`: after it, writes the tokens (group 0) or the group input, `rows_of(batch)`."""

    def __init__(self, boundary, store: HiddenStore, first_layer: int | None, rows_of=stream_residual):
        self.boundary, self.prepare = boundary, boundary.prepare
        self.store, self.first_layer, self.rows_of = store, first_layer, rows_of
        self.boundary.prepare = self

    def __call__(self, hidden_states, forward_batch, **kwargs):
        out = self.prepare(hidden_states, forward_batch, **kwargs)
        rows = None if self.first_layer is None else self.rows_of(forward_batch)
        write_rows(self.store, self.first_layer, forward_batch, rows)
        return out

    def remove(self) -> None:
        self.boundary.prepare = self.prepare


def at_stage_boundaries(layers, store: HiddenStore, boundary_of, rows_of=stream_residual) -> list:
    """Wraps `boundary_of(layer).prepare` on each group's first layer, storing `rows_of(forward_batch)` after it
    (default: the residual stream's value); returns the wrappers (each `remove()`s)."""
    first = store.layout.groups[0].first_layer
    return [_StageInputCapture(boundary_of(layers[first]), store, None)] + [
        _StageInputCapture(boundary_of(layers[g.first_layer]), store, g.first_layer, rows_of)
        for g in store.layout.stored_groups]


def _capture_layer_keywords(store: HiddenStore, first_layer: int | None, module, args, kwargs):
    if kwargs.get("forward_batch") is not None:
        write_rows(store, first_layer, kwargs["forward_batch"],
                   widened(kwargs["hidden_states"], store.layout.streams, store.layout.hidden_size))


def widened(rows, streams: int, hidden_size: int):
    """Rows as wide as the residual: the first layer of a model with hyper-connection streams receives the embedding
    [T, hidden] and widens it into `streams` copies itself (the capture stores the copies, so every row has one
    width; a text replay of group 0 widens the re-embedded ids the same way); streams as they are."""
    if rows is None or streams == 1 or rows.shape[-1] != hidden_size:
        return rows
    return rows.repeat(1, streams)


def at_layer_keyword_inputs(layers, store: HiddenStore) -> list:
    """Keyword pre-hooks on group 0's first decoder layer (the token ids) and on each stored group's (its input, all
    streams); returns the handles."""
    first = store.layout.groups[0].first_layer
    handles = [layers[first].register_forward_pre_hook(partial(_capture_layer_keywords, store, None),
                                                       with_kwargs=True)]
    for group in store.layout.stored_groups:
        hook = partial(_capture_layer_keywords, store, group.first_layer)
        handles.append(layers[group.first_layer].register_forward_pre_hook(hook, with_kwargs=True))
    return handles
