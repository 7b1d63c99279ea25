"""Jet-Nemotron's JetBlock (`JetNemotronForCausalLM`): a gated delta rule whose values pass through a dynamic
short convolution.

A JetBlock layer is norm -> qkvabz_proj -> (q, k, v, a, b, z); v goes through a causal conv of width K whose kernel
is generated per token from that token's normed input (`DynamicShortConvolution`), then q = silu(q), k = silu(k) and
the conv's output enter the gated delta rule (`fused_recurrent_gated_delta_rule_update`: g from a, beta = sigmoid(b),
q and k l2-normed inside) -> gated RMS norm with z -> o_proj, then the layer's MLP. The per-token kernels are no
state: a request's state is the last K - 1 raw v rows (the conv pool's last total_v channels; SGLang sizes the pool
as GDN's, whose q and k channels JetBlock leaves unused) and the delta-rule state S.

The replay runs each layer of a group through the model's own modules and kernel binding, from the slot's anchor
(or cleared) window and state, writing both back; the group's last layer computes only its states. The group input
is captured on the decoder layers, which carry the whole residual stream and are called positionally
(`capture.at_decoder_layer_inputs`).

Interval anchors. The prefill is one token-serial kernel call per layer (no chunk kernel, so no per-chunk states to
read), so the anchors are taken beside it, from the values the layer computes anyway:
- conv half: the K - 1 raw v rows before each offset, from the dynamic conv's own input, before JetBlock writes the
  new window (`IntervalAnchors.write_conv_states`, GDN's writer);
- SSM half: the request's kernel call runs in rounds cut at the anchors, as a chunked prefill would run it, and each
  anchor's state is copied out of the slot where its round ends (`run_in_rounds`): no work beyond the prefill's own
  (state-only passes beside the call would cost one more recurrence over the prefix; docs/models.md).
JetBlock's forward tells the two inner hooks which layer's pool and which batch they are in (`_EXTEND`).
"""

import contextvars
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tailreplay_sglang import capture
from tailreplay_sglang.families.base import FEED_FORWARD, Family, ReplayBatch, replayed_layer_requirements

_KERNEL = "fused_recurrent_gated_delta_rule_update"  # as the model module binds it (Triton, or the CPU port)
_MODULE = "sglang.srt.models.jet_nemotron"
_BLOCK = ("input_layernorm", "self_attn.qkvabz_proj", "self_attn.dynamic_conv1d", "self_attn.A_log",
          "self_attn.dt_bias", "self_attn.total_k_dim", "self_attn.total_v_dim", "self_attn.num_heads",
          "self_attn.head_k_dim", "self_attn.head_v_dim")
_OUTPUT = ("self_attn.o_norm", "self_attn.o_proj") + FEED_FORWARD


class JetFamily(Family):
    name = "jet"
    # JetBlock calls its kernel directly: SGLang's --linear-attn-prefill-backend choice does not reach it
    anchor_prefill_backends = None

    def install_capture(self, model, store) -> list:
        return capture.at_decoder_layer_inputs(model.layers, store)

    def replay_group(self, model, pool, group, x: torch.Tensor, batch: ReplayBatch) -> None:
        for layer_id in group.recurrent_layers:
            last = layer_id == group.recurrent_layers[-1]
            x = replay_layer(model.layers[layer_id], pool.mamba2_layer_cache(layer_id), x, batch, last)

    def required(self, model, layout) -> list:
        return replayed_layer_requirements(model, layout, lambda layer_id: _BLOCK, _OUTPUT)

    def required_kernels(self) -> tuple[str, ...]:
        return (f"{_MODULE}:{_KERNEL}",)


def _kernel():
    return getattr(sys.modules[_MODULE], _KERNEL)


class BlockInputs(NamedTuple):
    """What a JetBlock's kernel and output read, for T tokens: q, k [T, H, dk]; v (after the conv) [T, H, dv];
    g, beta [T, H]; z [T, H, dv]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    z: torch.Tensor


def block_inputs(block, h: torch.Tensor, window: torch.Tensor, seq_lens: torch.Tensor):
    """JetBlock's forward up to its kernel, through its own modules, from the normed input h [T, hidden] of packed
    sequences of `seq_lens` tokens whose conv windows (the K - 1 raw v rows before each) are `window` [B, total_v,
    K - 1]. Returns the kernel inputs and each sequence's new window."""
    T, H = h.shape[0], block.num_heads
    q, k, v, a, b, z = block.qkvabz_proj(h)[0].split(
        [block.total_k_dim, block.total_k_dim, block.total_v_dim, H, H, block.total_v_dim], dim=-1)
    v, new_window = block.dynamic_conv1d(v, conv_state=window, generator_input=h, seq_lens=seq_lens)
    g = -block.A_log.float().exp() * F.softplus(a.float() + block.dt_bias)
    return BlockInputs(F.silu(q).view(T, H, -1), F.silu(k).view(T, H, -1), v.view(T, H, -1), g, b.sigmoid(),
                       z.view(T, H, -1)), new_window


def replay_layer(layer, cache, x: torch.Tensor, batch: ReplayBatch, state_only: bool):
    """One JetNemotron decoder layer over the packed tails; the conv window and the delta-rule state land in the
    requests' slots. Returns the next residual-stream value, or None when only the states were needed."""
    block, slots = layer.self_attn, batch.mamba_slots
    conv = cache.conv[0][:, -block.total_v_dim:, :]  # JetBlock's part of a pool sized as GDN's
    seq_lens = torch.tensor(batch.tail_lens, device=x.device)
    h = layer.input_layernorm(x)
    inputs, window = block_inputs(block, h, conv[slots], seq_lens)
    conv[slots] = window.to(conv.dtype)
    batch.observe_decay(inputs.g)
    o = _kernel()(q=inputs.q[None], k=inputs.k[None], v=inputs.v[None], g=inputs.g[None], beta=inputs.beta[None],
                  initial_state_source=cache.temporal, initial_state_indices=slots, cu_seqlens=batch.cu_seqlens,
                  use_qk_l2norm_in_kernel=True, disable_output_calculation=state_only)
    if state_only:
        return None
    o = block.o_norm(o[0], inputs.z).reshape(x.shape[0], -1)
    x = x + block.o_proj(o)[0]  # RowParallelLinear: reduced over TP inside
    return x + batch.feed_forward(layer.mlp, layer.post_attention_layernorm(x))


# --- interval anchors (the INTERVAL_ANCHORS rows' bodies) --------------------------------------------------------


class _Extend(NamedTuple):
    conv: torch.Tensor  # this layer's conv pool, JetBlock's channels: [slots, total_v, K - 1]
    metadata: object  # the linear-attention backend's forward metadata (slots, sequence bounds)


_EXTEND: contextvars.ContextVar[_Extend | None] = contextvars.ContextVar("jet_extend", default=None)


def track_planned_extend(runtime, original, block, *args, **kwargs):
    """AROUND `JetBlock.forward`: in a prefill forward with planned anchors, the two hooks below learn this layer's
    conv pool and the batch layout for the call."""
    forward_batch = kwargs["forward_batch"]
    if not runtime.interval_anchors.by_slot or not forward_batch.forward_mode.is_extend():
        return original(block, *args, **kwargs)
    from sglang.srt.model_executor.forward_context import get_attn_backend

    backend = get_attn_backend().linear_attn_backend
    conv = backend.req_to_token_pool.mamba2_layer_cache(block.layer_id).conv[0]
    token = _EXTEND.set(_Extend(conv[:, -block.total_v_dim:, :], backend.forward_metadata))
    try:
        return original(block, *args, **kwargs)
    finally:
        _EXTEND.reset(token)


def write_anchor_conv_states(runtime, original, module, x, **kwargs):
    """AROUND `DynamicShortConvolution.forward` (x: the raw v rows, [T, total_v]): each planned anchor's window, the
    K - 1 rows before its offset, read before JetBlock writes the slots' new windows. JetBlock reads every slot's
    window (SGLang clears a new request's), so each sequence's left context is its slot's."""
    extend = _EXTEND.get()
    if extend is not None:
        meta = extend.metadata
        slots = meta.mamba_cache_indices
        runtime.interval_anchors.write_conv_states(x.transpose(0, 1), extend.conv, slots, meta.query_start_loc,
                                                   torch.ones(slots.shape[0], dtype=torch.bool))
    return original(module, x, **kwargs)


def write_anchor_ssm_states(runtime, original, *args, **kwargs):
    """AROUND the model module's delta-rule kernel (called with keywords): in a prefill with planned anchors, the call
    runs in rounds cut at the anchors, each anchor's state copied out of its sequence's slot when its round ends."""
    if _EXTEND.get() is None:
        return original(*args, **kwargs)
    return run_in_rounds(runtime.interval_anchors, original, kwargs)


def run_in_rounds(anchors, kernel, call: dict):
    """The kernel call `call` (packed sequences, each continuing from its slot's state) cut at every sequence's planned
    anchor offsets: round r runs each sequence's r-th segment, all in one call, from the state the previous round
    left in its slot; where a segment ends at an anchor, the slot's state is copied into the anchor's slot. The
    states pass through the pool between rounds as they do between the chunks of a chunked prefill (float32 by
    default: bit-equal to one call). An anchor at offset 0 (a replayed hit's match end) is the slot's state before the
    call. Returns the outputs of the whole call, in its token order."""
    states, indices = call["initial_state_source"], call["initial_state_indices"]
    bounds, slots = anchors.layout("bounds", call["cu_seqlens"]), anchors.layout("slots", indices)
    plans = [dict(anchors.by_slot.get(slot, ())) for slot in slots]  # offset -> anchor slot, per sequence
    cuts = [sorted({0, bounds[i + 1] - bounds[i]} | {off for off in plan if off < bounds[i + 1] - bounds[i]})
            for i, plan in enumerate(plans)]
    _copy_anchors(anchors, states, slots, plans, [0] * len(slots))
    if all(len(c) == 2 for c in cuts):
        return kernel(**call)
    out = None
    for r in range(max(len(c) for c in cuts) - 1):
        live = [i for i, c in enumerate(cuts) if r < len(c) - 1]
        rows = torch.cat([torch.arange(bounds[i] + cuts[i][r], bounds[i] + cuts[i][r + 1]) for i in live])
        rows = rows.to(indices.device)
        lengths = torch.tensor([0] + [cuts[i][r + 1] - cuts[i][r] for i in live])
        part = kernel(**dict(call, **{name: call[name][:, rows] for name in ("q", "k", "v", "g", "beta")},
                             initial_state_indices=indices[torch.tensor(live, device=indices.device)],
                             cu_seqlens=lengths.cumsum(0).to(call["cu_seqlens"].dtype).to(indices.device)))
        if out is None:
            out = part.new_empty(1, call["q"].shape[1], *part.shape[2:])
        out[:, rows] = part
        _copy_anchors(anchors, states, [slots[i] for i in live], [plans[i] for i in live],
                      [cuts[i][r + 1] for i in live])
    return out


def _copy_anchors(anchors, states, slots, plans, ends) -> None:
    """Each sequence whose segment ended at `ends[i]` where an anchor is planned: its slot's state into the anchor."""
    for slot, plan, end in zip(slots, plans, ends):
        dst = plan.get(end)
        if dst is not None:
            states[dst] = states[slot]
            anchors.written["ssm"].add(dst)


FAMILY = JetFamily()
