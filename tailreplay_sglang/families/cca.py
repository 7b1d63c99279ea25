"""ZAYA1's CCA attention (`ZayaForCausalLM`): attention whose per-request state beside its KV is a short window, so
every hit is rebuilt exactly from the embeddings, with no hidden store.

A ZAYA1 stack alternates CCA attention layers and MoE layers (SGLang's `models/zaya.py`). A CCA layer projects its
input to q and k, runs a two-stage causal conv over them (`conv_qk`, kernels cca_time0 and cca_time1) and takes half
of each value head from the previous token's input (`val_proj2`). Its per-request state is therefore the last W =
(cca_time0 - 1) + (cca_time1 - 1) rows of `W_q x || W_k x` (`conv[0]` of its mamba slot) and the last input (`conv[1]`,
prev_hs): a function of the layer's last W inputs. The MoE layers carry nothing across tokens (their router's EDA
state runs across layers within a token).

So the replay needs no stored hiddens: one group, all of the stack up to the last CCA layer, fed by the embeddings
of the last W x L matched tokens (L = the CCA layers; `state_window`). From a cleared slot, layer l's q is exact
from the tail's (W x (l + 1))-th token on, and its output with it, because every key and value it attends to is
read from the KV cache the first prefill wrote (exact for every matched position; the replay writes none). Each
layer's state needs only its last W inputs exact, so every state is exact at the match end, at any token boundary.
The last CCA layer computes only its state; the MoE layers after it feed nothing a state depends on.

Everything but the attention itself is the model's own code: the residual merge and norm (`_ResidualMergeRead`), the
projections and `cca_extend` (which writes both states into the slots from a zero left pad), `_add_grouped_qk_means`
and `_normalize_qk`, the rotary embedding, `o_proj` and the MoE block.
"""

import torch
import torch.nn.functional as F

from tailreplay_sglang import capture
from tailreplay_sglang.families.base import Family, ReplayBatch, layer_requirements, reduction_owner, tp_reduced

_ZAYA = "sglang.srt.models.zaya"
_ATTENTION = ("input_norm", "res_scale", "self_attn.qkv.linear_q", "self_attn.qkv.linear_k", "self_attn.qkv.conv_qk",
              "self_attn.qkv._add_grouped_qk_means", "self_attn.qkv._normalize_qk", "self_attn.rotary_emb",
              "self_attn.o_proj", "self_attn.scale", "self_attn.attn.layer_id")
_MOE = ("input_norm", "res_scale", "zaya_block")


class CcaFamily(Family):
    name = "cca"

    def state_window(self, layout) -> int | None:
        """W x L: every CCA layer's state is its last W inputs, and the l-th layer's outputs are exact W x (l + 1)
        tokens into a replay from cleared slots."""
        return (layout.conv_kernel - 1) * sum(len(group.recurrent_layers) for group in layout.groups)

    def install_capture(self, model, store) -> list:
        return capture.at_layer_keyword_inputs(model.layers, store)  # the token ids: nothing else is stored

    def replay_group(self, model, pool, group, x: torch.Tensor, batch: ReplayBatch) -> None:
        from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
        from sglang.srt.models.zaya import _ResidualMergeRead

        context = PassContext.of(batch, pool, x.device)
        residual, router = None, None
        for layer_id in group.layers:
            layer = model.layers[layer_id]
            read = _ResidualMergeRead(layer.res_scale)
            if residual is None:  # layer 0: the embedding, scaled, is the residual stream's first value
                residual = read.init_residual(x)
                h = read.read(residual, layer.input_norm)[0]
            else:
                h, residual = read.update_and_read(PLAIN_ADD, x, residual, layer.input_norm)
            if hasattr(layer, "self_attn"):
                x = replay_cca_layer(layer.self_attn, pool.mamba2_layer_cache(layer_id).conv, h, batch, context,
                                     state_only=layer_id == group.recurrent_layers[-1])
            else:
                x, router = layer.zaya_block(h, router)
                x = tp_reduced(x, reduction_owner(layer.zaya_block))

    def required(self, model, layout) -> list:
        needs = []
        for group in layout.groups:  # the CCA layers are the recurrent ones; the MoE layers between them are replayed
            needs += layer_requirements(model, group.recurrent_layers, _ATTENTION)
            needs += layer_requirements(model, [i for i in group.layers if i not in group.recurrent_layers], _MOE)
        return needs

    def required_kernels(self) -> tuple[str, ...]:
        return (f"{_ZAYA}:cca_extend", f"{_ZAYA}:_ResidualMergeRead",
                "sglang.srt.layers.layer_boundary.residual.add_norm:PLAIN_ADD")


class PassContext:
    """What every CCA layer of a pass shares: the tails' positions, mamba slots on the host (`cca_extend` indexes
    the pool with them), and each tail's KV slots from position 0 to its match end with its causal mask."""

    def __init__(self, batch: ReplayBatch, pool, device):
        self.positions = batch.token_positions(device)
        self.slots = batch.mamba_slots.tolist()  # one read per pass (a sync on a GPU)
        self.kv_rows, self.masks = [], []
        for row, start, n in zip(batch.pool_rows, batch.tail_starts, batch.tail_lens):
            end = start + n
            self.kv_rows.append(pool.req_to_token[row, :end].long())
            positions = torch.arange(end, device=device)
            self.masks.append(positions[None, :] <= positions[start:, None])  # [n, end]: keys up to each query

    @classmethod
    def of(cls, batch: ReplayBatch, pool, device) -> "PassContext":
        if "cca" not in batch.pass_state:
            batch.pass_state["cca"] = cls(batch, pool, device)
        return batch.pass_state["cca"]


def replay_cca_layer(attn, states, h: torch.Tensor, batch: ReplayBatch, context: PassContext, state_only: bool):
    """One CCA attention layer over the packed tails from cleared slots; both of its states land in the requests'
    slots. Returns the layer's output (before the next layer's residual merge), or None when only the state was
    needed."""
    from sglang.srt.models.zaya import cca_extend

    cca = attn.qkv
    q_raw, _ = cca.linear_q(h)
    k_raw, _ = cca.linear_k(h)
    qk_out, _ = cca_extend(torch.cat([q_raw, k_raw], dim=-1), h, cca.conv_qk, states[0], states[1], context.slots,
                           [False] * len(batch.tail_lens), batch.tail_lens, cca.total_padding)
    if state_only:
        return None
    t, d = h.shape[0], cca.head_dim
    query, key = cca._add_grouped_qk_means(qk_out[:, :cca.latent_q_dim].view(t, cca.num_q_heads, d),
                                           qk_out[:, cca.latent_q_dim:].view(t, cca.num_k_heads, d),
                                           q_raw.view(t, cca.num_q_heads, d), k_raw.view(t, cca.num_k_heads, d))
    query, key = cca._normalize_qk(query, key)
    q, _ = attn.rotary_emb(context.positions, query.reshape(t, -1).to(h.dtype), key.reshape(t, -1).to(h.dtype))
    out = cached_kv_attention(q.view(t, cca.num_q_heads, d), batch, context, attn.attn.layer_id, attn.scale)
    projected, _ = attn.o_proj(out.reshape(t, -1))
    return tp_reduced(projected, attn.o_proj)


def cached_kv_attention(q: torch.Tensor, batch: ReplayBatch, context: PassContext, layer_id: int,
                        scale: float) -> torch.Tensor:
    """Causal attention of the tails' queries [T, heads, d] over the keys and values the KV cache holds for every
    position up to each query's own (the first prefill's, exact), per tail."""
    keys, values = batch.kv_pool.get_key_buffer(layer_id), batch.kv_pool.get_value_buffer(layer_id)
    out, offset = torch.empty_like(q), 0
    for rows, mask, n in zip(context.kv_rows, context.masks, batch.tail_lens):
        k, v = keys[rows].to(q.dtype), values[rows].to(q.dtype)  # [end, kv heads, d]
        groups = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(groups, dim=1).transpose(0, 1) for t in (k, v))
        tail = F.scaled_dot_product_attention(q[offset:offset + n].transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        out[offset:offset + n] = tail.transpose(0, 1)
        offset += n
    return out


FAMILY = CcaFamily()
