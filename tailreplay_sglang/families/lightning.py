"""Lightning attention (Ling-2.5, `BailingMoeV2_5ForCausalLM`).

A layer is input norm -> lightning mixer (`BailingMoELinearAttention` at `.attention`: q | k | v from one projection,
per-head q/k RMSNorm, RoPE at the token's position, linear attention whose state decays by a fixed rate per head
and layer, groupwise RMSNorm gated by sigmoid(g_proj), `dense`) -> post-attention norm -> dense MLP or MoE, each added
back to the residual stream behind the same stage boundaries as KDA's layers; the group's last layer computes only
its states. The kernel is SGLang's `seg_la_fwd` (Triton on a GPU, whatever binds it on a CPU), reached at its
defining module, with the decay rates SGLang's lightning backend builds (`_build_slope_tensor`). The mixer rotates
q and k, so the replay passes each tail token's position (`ReplayBatch.token_positions`).

The group input is captured at the layer's `attn_boundary`. There is no conv state (the pool's conv is zero-size).
Interval anchors: seg_la keeps no per-chunk states, but the decay does not depend on the data, so an anchor's state
is a closed form of the state entering the extend and the keys and values before it (`ops.lightning.scan`, state
only), computed around the backend's kernel call from the q, k, v it receives (`write_anchor_states`).
The survival bound of a zero-init tail is `exp(-slope * k)` per head: with the layerwise factor going to zero in the
last layers it is close to 1 there, so zero-init tails of a Ling-2.5 are reported as barely decayed; exact anchored
replays are the ones to rely on.
"""

import pkgutil

import torch
import torch.nn.functional as F

from tailreplay_sglang import capture
from tailreplay_sglang.families.base import (Family, ReplayBatch, layer_requirements, reduction_owner,
                                             replayed_layer_requirements, tp_reduced)
from tailreplay_sglang.ops import lightning
from tailreplay_sglang.store.transfer import pin

_SEG_LA = "sglang.kernels.ops.attention.linear.seg_la"
_NORM = "sglang.kernels.ops.attention.fla.layernorm_gated:layernorm_fn"
_SLOPES = "sglang.srt.layers.attention.linear.lightning_backend:LightningAttentionBackend"
_MIXER = ("query_key_value", "use_qk_norm", "linear_silu", "linear_rope", "linear_scale", "rotary_emb", "tp_heads",
          "tp_kv_heads", "head_dim", "q_size_per_rank", "kv_size_per_rank", "scaling", "rms_norm_eps", "g_proj",
          "g_norm", "group_norm_size", "dense", "attn.scaling", "layer_id")


class LightningFamily(Family):
    name = "lightning"
    anchor_prefill_backends = None  # the lightning backend ignores --linear-attn-prefill-backend

    def install_capture(self, model, store) -> list:
        return capture.at_stage_boundaries(model.layers, store, lambda layer: layer.attn_boundary)

    def replay_group(self, model, pool, group, x: torch.Tensor, batch: ReplayBatch) -> None:
        positions = batch.token_positions(x.device)
        rates = slopes(model.config)
        for layer_id in group.recurrent_layers:
            layer, rate = model.layers[layer_id], pin(rates[layer_id]).to(x.device, non_blocking=True)
            out = replay_lightning_mixer(layer.attention, pool.mamba2_layer_cache(layer_id).temporal,
                                         layer.input_layernorm(x), positions, rate, batch,
                                         state_only=layer_id == group.recurrent_layers[-1])
            batch.observe_decay(-rate.reshape(1, -1).expand(x.shape[0], -1))
            if out is None:
                return
            x = x + tp_reduced(out, layer.attention.dense)
            x = x + tp_reduced(layer.mlp(layer.post_attention_layernorm(x)), reduction_owner(layer.mlp))

    def required(self, model, layout) -> list:
        boundaries = layer_requirements(model, [g.first_layer for g in layout.groups], ("attn_boundary.prepare",))
        mixer = ("input_layernorm",) + tuple(f"attention.{p}" for p in _MIXER)
        return [(model, "config", "model")] + boundaries + replayed_layer_requirements(model, layout,
                                                                                      lambda layer_id: mixer)

    def required_kernels(self) -> tuple[str, ...]:
        return (f"{_SEG_LA}:seg_la_fwd", f"{_SEG_LA}:SegLaMeta", _NORM, f"{_SLOPES}._build_slope_tensor")


def slopes(config) -> list[torch.Tensor]:
    """[layers] of [this rank's heads, 1, 1] on the host: each layer's decay rates, as SGLang's lightning backend
    builds them."""
    backend = pkgutil.resolve_name(_SLOPES)
    heads = getattr(config, "num_linear_key_value_heads", config.num_attention_heads)
    return backend._build_slope_tensor(heads, config.num_hidden_layers, "cpu",
                                       layerwise_decay=getattr(config, "lightning_layerwise_decay", True))


def lightning_qkv(mixer, h: torch.Tensor, positions: torch.Tensor):
    """The mixer's q, k, v [T, heads, head_dim] (float32) from its normed input h, as its forward computes them."""
    qkv, _ = mixer.query_key_value(h)
    qkv = qkv.to(torch.float32)
    if mixer.linear_silu:
        qkv = F.silu(qkv)
    q, k, v = torch.split(qkv, [mixer.q_size_per_rank, mixer.kv_size_per_rank, mixer.kv_size_per_rank], dim=-1)
    if mixer.use_qk_norm:
        norm = pkgutil.resolve_name(_NORM)
        q = norm(q.reshape(-1, mixer.tp_heads, mixer.head_dim), mixer.query_layernorm.weight.data, bias=None,
                 eps=mixer.rms_norm_eps, is_rms_norm=True).reshape(-1, mixer.q_size_per_rank)
        k = norm(k.reshape(-1, mixer.tp_kv_heads, mixer.head_dim), mixer.key_layernorm.weight.data, bias=None,
                 eps=mixer.rms_norm_eps, is_rms_norm=True).reshape(-1, mixer.kv_size_per_rank)
    if mixer.linear_rope:
        q, k = mixer.rotary_emb(positions, q, k)
    T = h.shape[0]
    q, k, v = (t.reshape(T, -1, mixer.head_dim) for t in (q, k, v))
    if mixer.linear_scale:
        q = q * mixer.scaling
    return q, k, v


def replay_lightning_mixer(mixer, states: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                           rate: torch.Tensor, batch: ReplayBatch, state_only: bool = False):
    """One lightning mixer over the tails (h: the normed input [T, hidden]), every tail from its slot's state in
    `states` ([slots, heads, D, D]). Returns the mixer's output before its TP reduction [T, hidden], or None when
    `state_only` (the states are written either way)."""
    seg_la = pkgutil.resolve_name(f"{_SEG_LA}:seg_la_fwd")
    meta_class = pkgutil.resolve_name(f"{_SEG_LA}:SegLaMeta")
    q, k, v = lightning_qkv(mixer, h, positions)
    cu = batch.cu_seqlens.to(torch.int32)
    n = len(batch.tail_lens)
    meta = meta_class(batch_size=n, max_q_length=None, q_offsets=cu, s_offsets=batch.mamba_slots.to(torch.int32),
                      q_lengths=cu.diff(), s_scales=torch.ones(n, dtype=torch.int32, device=h.device))
    o = seg_la(q=q, k=k, v=v, s=states, decay_scales=rate, meta=meta, softmax_scale=mixer.attn.scaling)
    if state_only:
        return None
    hidden = o.reshape(h.shape[0], -1).to(h.dtype)
    gate, _ = mixer.g_proj(h)
    if mixer.group_norm_size > 1:
        hidden = mixer.g_norm(hidden, gate)
    else:
        hidden = torch.sigmoid(gate) * mixer.g_norm(hidden)
    out, _ = mixer.dense(hidden.to(h.dtype))
    return out


def write_anchor_states(runtime, original, backend, q, k, v, kv_cache, state_indices_tensor, metadata, layer,
                        *args, **kwargs):
    """AROUND SGLang's lightning kernel call (`LightningAttentionBackend._linear_attention_entry`, every device): each
    planned anchor's state, from the state entering the extend (read before the kernel updates the slot) and the
    keys and values the kernel gets, by the closed form (`ops.lightning.scan`)."""
    anchors = runtime.interval_anchors
    # The plan is the prefill forward's: the decode and verify forwards after it call this kernel too, and must not
    # write the anchors again from their own tokens
    if not anchors.by_slot or metadata.num_prefills == 0 or kwargs.get("temp_cache") is not None:
        return original(backend, q, k, v, kv_cache, state_indices_tensor, metadata, layer, *args, **kwargs)
    n = metadata.num_prefills
    bounds = anchors.layout("bounds", metadata.query_start_loc[:n + 1])
    slots = anchors.layout("slots", state_indices_tensor[:n])
    initial = anchors.layout("initial", metadata.has_initial_states[:n])
    planned = [(i, slot) for i, slot in enumerate(slots) if slot in anchors.by_slot]
    entering = {slot: kv_cache[slot].clone() if initial[i] else torch.zeros_like(kv_cache[slot])
                for i, slot in planned}
    out = original(backend, q, k, v, kv_cache, state_indices_tensor, metadata, layer, *args, **kwargs)
    rate = backend.tp_slope[layer.layer_id]
    for i, slot in planned:
        cuts = anchors.by_slot[slot]
        start, stop = bounds[i], bounds[i] + max(offset for offset, _ in cuts)
        _, _, states = lightning.scan(None, k[start:stop], v[start:stop], rate, entering[slot], 0.0,
                                      ends=[offset for offset, _ in cuts], state_only=True)
        for (_, dst), state in zip(cuts, states):
            kv_cache[dst] = state.to(kv_cache.dtype)
            anchors.mark_written(dst)
    return out


FAMILY = LightningFamily()
