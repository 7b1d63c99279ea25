"""Mamba2 (Nemotron-H, Granite-4.0-H).

- Nemotron-H: every layer is one stage (a Mamba2 mixer, attention, MLP or MoE) behind its stage boundary `boundary`;
  a group is the run of stages between two attention stages, cut after its last Mamba2 stage, and the MLP or MoE
  stages between its Mamba2 stages are replayed (their forward needs no batch).
- Granite-4.0-H: a layer is norm -> Mamba2 mixer (`mamba`) and norm -> MoE + shared MLP, each scaled by the residual
  multiplier before it is added back, behind `attn_boundary`; group 0 starts from the embeddings times the
  embedding multiplier.

The mixer is replayed through the model's own projections, conv weights and norm and through SGLang's kernel names
(`layers/attention/mamba/mamba.py`: its Triton causal conv and SSD scan on a GPU, whatever binds them on a CPU),
every tail from its slot's state. Interval anchors come from the scan's per-chunk states, which lie on one grid of
`mamba_chunk_size` over the packed batch: an anchor is written where its position falls on that grid, its conv state
from the mixer's input rows before it. A replayed hit's match end is not on that grid, so it is never an anchor.
"""

import torch

from tailreplay_sglang import capture
from tailreplay_sglang.families.base import Family, ReplayBatch, layer_requirements, reduction_owner, tp_reduced
from tailreplay_sglang.ops.ssd import process_dt

_MAMBA = "sglang.srt.layers.attention.mamba.mamba"
_MIXER = ("in_proj", "conv1d.weight", "conv1d.bias", "activation", "A", "D", "dt_bias", "norm", "out_proj", "tp_size",
          "num_heads", "head_dim", "n_groups", "groups_ssm_state_size", "intermediate_size", "conv_dim")
_CHUNK_METADATA = ("sglang.srt.layers.attention.mamba.mamba2_metadata:Mamba2Metadata"
                   "._query_start_loc_to_chunk_indices_offsets")


def _is_granite(layer) -> bool:
    return hasattr(layer, "mamba")


def _boundary(layer):
    return layer.attn_boundary if _is_granite(layer) else layer.boundary


class Mamba2Family(Family):
    name = "mamba2"
    anchor_at_replay_end = False

    def anchor_grid(self, layout) -> int:
        return layout.chunk_size

    def install_capture(self, model, store) -> list:
        return capture.at_stage_boundaries(model.layers, store, _boundary)

    def replay_group(self, model, pool, group, x: torch.Tensor, batch: ReplayBatch) -> None:
        """The group's layers in order; the last Mamba2 layer computes only its states."""
        chunk_size = model.config.mamba_chunk_size
        for layer_id in group.layers:
            layer = model.layers[layer_id]
            if layer_id not in group.recurrent_layers:  # a Nemotron-H MLP or MoE stage between two Mamba2 stages
                x = x + tp_reduced(layer.mixer(layer.norm(x)), reduction_owner(layer.mixer))
                continue
            granite = _is_granite(layer)
            mixer, norm = (layer.mamba, layer.input_layernorm) if granite else (layer.mixer, layer.norm)
            last = layer_id == group.recurrent_layers[-1]
            out, log_decay = replay_mixer(mixer, pool.mamba2_layer_cache(layer_id), norm(x), batch.cu_seqlens,
                                          batch.tail_lens, batch.mamba_slots, chunk_size, last)
            batch.observe_decay(log_decay)
            if last:
                return
            scale = getattr(layer, "residual_multiplier", 1.0)
            x = x + scale * tp_reduced(out, mixer.out_proj)
            if granite:
                x = x + scale * tp_reduced(_granite_ffn(layer, layer.post_attention_layernorm(x)), mixer.out_proj)

    def required(self, model, layout) -> list:
        needs = [(model, "config.mamba_chunk_size", "model")]
        for group in layout.groups:
            for layer_id in group.layers:
                layer = model.layers[layer_id]
                granite = _is_granite(layer)
                if layer_id not in group.recurrent_layers:
                    paths = ("norm", "mixer")
                elif granite:
                    paths = ("input_layernorm", "post_attention_layernorm", "block_sparse_moe",
                             "shared_mlp") + tuple(f"mamba.{p}" for p in _MIXER)
                else:
                    paths = ("norm",) + tuple(f"mixer.{p}" for p in _MIXER)
                if layer_id == group.first_layer:  # the capture wraps its entry boundary
                    paths += ("attn_boundary.prepare" if granite else "boundary.prepare",)
                needs += layer_requirements(model, [layer_id], paths)
        return needs

    def required_kernels(self) -> tuple[str, ...]:
        return (f"{_MAMBA}:causal_conv1d_fn_triton", f"{_MAMBA}:mamba_chunk_scan_combined", _CHUNK_METADATA)


def _granite_ffn(layer, h: torch.Tensor) -> torch.Tensor:
    """Granite-4.0-H's feed-forward as its layer runs it: MoE (which may write its input: given a copy) plus the
    shared MLP, either of which may be absent; a TP partial sum like the mixer's (all built with
    reduce_results=False)."""
    out = torch.zeros_like(h)
    if layer.block_sparse_moe is not None:
        out = out + layer.block_sparse_moe(h.clone())
    if layer.shared_mlp is not None:
        out = out + layer.shared_mlp(h)
    return out


def _kernels():
    from sglang.srt.layers.attention.mamba import mamba

    return mamba


def _chunk_metadata(cu_seqlens: torch.Tensor, chunk_size: int, total: int):
    """seq_idx, chunk_indices and chunk_offsets of the packed tails, as SGLang's Mamba2 metadata computes them for
    a prefill whose sequences have initial states."""
    from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata

    lens = cu_seqlens.diff()
    seq_idx = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32, device=cu_seqlens.device), lens)
    chunk_indices, chunk_offsets = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(cu_seqlens, chunk_size,
                                                                                             total)
    return seq_idx.unsqueeze(0), chunk_indices, chunk_offsets


def replay_mixer(mixer, cache, h: torch.Tensor, cu_seqlens: torch.Tensor, tail_lens: list[int],
                 mamba_slots: torch.Tensor, chunk_size: int, state_only: bool):
    """One Mamba2 mixer over the tails (h: the normed layer input [T, hidden]). Returns (the mixer's output before
    any TP sum, or None when only the states were needed; the log-decays dt * A [T, heads] for the survival bound).
    Every tail starts from its slot's state (an anchor's copy or a cleared state), so all rows have one."""
    kernels = _kernels()
    tp = mixer.tp_size
    heads, head_dim = mixer.num_heads // tp, mixer.head_dim
    groups_state = mixer.groups_ssm_state_size // tp
    T = h.shape[0]
    projected, _ = mixer.in_proj(h)
    gate, xbc, dt = torch.split(projected, [mixer.intermediate_size // tp, mixer.conv_dim // tp, heads], dim=-1)
    cu = cu_seqlens.to(torch.int32)
    slots = mamba_slots.to(torch.int32)
    weight = mixer.conv1d.weight.view(mixer.conv1d.weight.size(0), mixer.conv1d.weight.size(2))
    xbc = kernels.causal_conv1d_fn_triton(
        xbc.transpose(0, 1), weight, mixer.conv1d.bias, activation=mixer.activation, conv_states=cache.conv[0],
        has_initial_state=torch.ones(len(tail_lens), dtype=torch.bool, device=h.device), cache_indices=slots,
        query_start_loc=cu, seq_lens_cpu=tail_lens).transpose(0, 1)[:T]
    x, B, C = torch.split(xbc, [mixer.intermediate_size // tp, groups_state, groups_state], dim=-1)
    seq_idx, chunk_indices, chunk_offsets = _chunk_metadata(cu, chunk_size, T)
    ssm = cache.temporal
    out = torch.empty(T, heads * head_dim, dtype=h.dtype, device=h.device)
    groups = mixer.n_groups // tp
    finals = kernels.mamba_chunk_scan_combined(
        x.reshape(1, T, heads, head_dim), dt.unsqueeze(0), mixer.A, B.reshape(1, T, groups, -1),
        C.reshape(1, T, groups, -1), chunk_size=chunk_size, D=mixer.D, z=None, dt_bias=mixer.dt_bias,
        seq_idx=seq_idx, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, cu_seqlens=cu,
        initial_states=ssm[mamba_slots], return_varlen_states=True, dt_softplus=True,
        out=out.view(1, T, heads, head_dim), state_dtype=ssm.dtype)
    ssm[mamba_slots] = finals.to(ssm.dtype)
    log_decay = process_dt(dt, mixer.dt_bias, dt_softplus=True) * mixer.A.float()
    if state_only:
        return None, log_decay
    return mixer.out_proj(mixer.norm(out, gate))[0], log_decay


def write_anchor_states(runtime, original, mixer, *args, **kwargs):
    """AROUND SGLang's `MambaMixer2.forward` (every device; called with keywords): the planned anchors' states of
    this layer, from the per-chunk states the mixer's scan returned."""
    out = original(mixer, *args, **kwargs)
    write_states(runtime.interval_anchors, mixer, kwargs["hidden_states"], kwargs["layer_cache"], kwargs["metadata"],
                 out[1])
    return out


def write_states(anchors, mixer, hidden_states, layer_cache, metadata, chunk_states) -> None:
    """After one mixer's prefill: each planned anchor whose position lies on the scan's chunk grid over the packed
    batch gets its SSM state from the per-chunk states (`chunk_states[0, position // chunk]`, the grid SGLang's
    extra_buffer reads too) and its conv state from the width - 1 mixer inputs before it, put through the mixer's
    own input projection again (a few rows). Off the grid (a sequence not starting on it, in a batched prefill) the
    anchor is not written, so it is freed at commit: fewer anchors, never a wrong one."""
    if not anchors.by_slot or chunk_states is None or metadata.num_prefills == 0:
        return
    n = metadata.num_prefills
    chunk = metadata.mixed_metadata.chunk_size
    bounds = anchors.layout("bounds", metadata.query_start_loc[:n + 1])
    slots = anchors.layout("slots", metadata.mamba_cache_indices[:n])
    conv, ssm = layer_cache.conv[0], layer_cache.temporal
    width_1 = conv.shape[-1]
    for i, slot in enumerate(slots):
        for offset, dst in anchors.by_slot.get(slot, ()):
            position = bounds[i] + offset
            if position % chunk or offset < width_1:
                continue
            ssm[dst] = chunk_states[0, position // chunk].to(ssm.dtype)
            projected, _ = mixer.in_proj(hidden_states[position - width_1:position])
            tp = mixer.tp_size
            window = projected[:, mixer.intermediate_size // tp:(mixer.intermediate_size + mixer.conv_dim) // tp]
            conv[dst] = window.transpose(0, 1).to(conv.dtype)
            anchors.mark_written(dst)


FAMILY = Mamba2Family()
