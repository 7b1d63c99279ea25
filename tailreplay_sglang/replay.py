"""The replay pass: rebuild hit requests' GDN states from a tail of their matched prefix, before their extend.

On a hit of m tokens a request's mamba slot holds either a copy of the anchor state kept at depth c
(`cache/component.py`: anchored, exact), and it replays [c, m), or a cleared state, and it replays the paper's tail [m - k, m) with
k = config.tail_len(m) (approximate unless k = m). Every group replays independently from its slot state over those
tokens: group 0 from the embeddings of the tokens, later groups from the hidden store. Inside a group each GDN
layer runs input norm -> projections -> conv -> GDN (`kernels.replay.replay_gdn_layer`: Triton on GPU, the torch
ops on CPU) with its states written into the request's slot; the group's last GDN layer computes only its state
(its outputs, norm, output projection and FFN feed nothing the next group uses). OLMo-Hybrid's GDN layers are
pre-norm like Qwen3.5's (its post-norm attention layers are never replayed), so the same layer recipe serves it,
with its own projections and beta = 2 sigmoid(b) (`gdn_inputs`, `beta_scale`). All hit requests of a prefill
batch replay together as one varlen batch.

For a zero-init tail the pass also reports how much of the dropped prefix state could still count at m: the
largest, over GDN layers and heads, of exp(sum of the log-gates over the tail). Each GDN step multiplies the state by
its gate and a non-expansive (I - beta k k^T) (unit-norm k, beta in (0, 2]), so this bounds, in operator norm, the
share of the true state at m - k that survives to m (`tail_replay_state_survival`).
"""

import logging
import time
from dataclasses import dataclass

import torch

from tailreplay_sglang import visibility
from tailreplay_sglang.config import TailReplayConfig
from tailreplay_sglang.layout import KDA, MAMBA2
from tailreplay_sglang.ops.gdn import gdn_gating
from tailreplay_sglang.store.hidden_store import TOKENS, HiddenStore
from tailreplay_sglang.kernels.replay import replay_gdn_layer
from tailreplay_sglang.replay_kda import replay_kda_mixer
from tailreplay_sglang.replay_mamba2 import replay_mixer
from tailreplay_sglang.cache.pending import Match, PendingReplays
from tailreplay_sglang.store.transfer import HostToDevice

logger = logging.getLogger(__name__)


@dataclass
class ReplayBatch:
    """One packed varlen replay: tails of all hit requests in a prefill batch."""

    kv_slots: torch.Tensor  # [sum k] KV slot of every replayed token
    cu_seqlens: torch.Tensor  # [n + 1]
    mamba_slots: torch.Tensor  # [n] each request's mamba slot: a copied anchor state or a cleared one
    tail_lens: list[int]
    reqs: list
    log_survival: torch.Tensor | None = None  # [n] filled by `run`: max over layers and heads of the tail's log-gates


def replay_start(match: Match, config: TailReplayConfig) -> int:
    """First replayed position of a hit: its anchor, or the start of the zero-init tail."""
    if match.anchor is not None:
        return match.anchor
    return match.matched - config.tail_len(match.matched)


def plan(runner, forward_batch, rows: list[tuple[int, Match, object]], config: TailReplayConfig) -> ReplayBatch | None:
    pool = runner.req_to_token_pool
    req_pool_indices = forward_batch.req_pool_indices
    spans, mamba_rows, lens, reqs = [], [], [], []
    for row, match, req in rows:
        start = replay_start(match, config)
        if start == match.matched:  # an anchor at the match end, or the paper's zero mode: nothing to replay
            continue
        pool_idx = req_pool_indices[row]
        spans.append(pool.req_to_token[pool_idx, start:match.matched].long())
        mamba_rows.append(pool_idx)
        lens.append(match.matched - start)
        reqs.append(req)
    if not spans:
        return None
    mamba_slots = pool.get_mamba_indices(torch.stack(mamba_rows)).long()
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return ReplayBatch(torch.cat(spans), cu.to(mamba_slots.device), mamba_slots, lens, reqs)


@torch.no_grad()
def run(runner, store: HiddenStore, batch: ReplayBatch, h2d_mode: str = "ovl") -> None:
    model, pool = runner.model.model, runner.req_to_token_pool
    dtype = model.embed_tokens.weight.dtype
    h2d = HostToDevice(runner.device, h2d_mode)
    inputs = store.fetch_tail(batch.kv_slots, h2d)  # every load launched up front (a no-op on the device tier)
    batch.log_survival = torch.full((len(batch.reqs),), float("-inf"), device=batch.mamba_slots.device)
    for group in store.layout.groups:
        key = group.first_layer if store.is_stored(group.first_layer) else TOKENS
        h2d.wait(key)  # group g's replay waits for its own input only, not for later groups' loads
        if key == TOKENS:  # group 0: fed by the embeddings of the tail tokens (Granite scales them)
            x = model.embed_tokens(inputs[key]) * getattr(model, "embedding_multiplier", 1.0)
        else:
            x = store.decode(inputs[key], dtype)
        if store.layout.mixer == MAMBA2:
            replay_mamba2_group(model, pool, group, x, batch)
            continue
        if store.layout.mixer == KDA:
            replay_kda_group(model, pool, group, x, batch)
            continue
        for i, layer_id in enumerate(group.recurrent_layers):
            last = i == len(group.recurrent_layers) - 1
            x = replay_layer(model.layers[layer_id], pool.mamba2_layer_cache(layer_id), x, batch, state_only=last)


def replay_mamba2_group(model, pool, group, x: torch.Tensor, batch: ReplayBatch) -> None:
    """A Mamba2 model's group, its layers in order; the last Mamba2 layer computes only its states.
    - Nemotron-H: a Mamba2 stage is norm -> mixer (`replay_mamba2`), an MLP or MoE stage norm -> MLP or MoE (its
      forward needs no batch), each added back;
    - Granite-4.0-H: a layer is norm -> Mamba2 mixer and norm -> MoE + shared MLP, each scaled by the residual
      multiplier before it is added back."""
    chunk_size = model.config.mamba_chunk_size
    for layer_id in group.layers:
        layer = model.layers[layer_id]
        if layer_id not in group.recurrent_layers:  # a Nemotron-H MLP or MoE stage between two Mamba2 stages
            x = x + _tp_reduced(layer.mixer(layer.norm(x)), _reduction_owner(layer.mixer))
            continue
        granite = hasattr(layer, "mamba")
        mixer, norm = (layer.mamba, layer.input_layernorm) if granite else (layer.mixer, layer.norm)
        last = layer_id == group.recurrent_layers[-1]
        out, log_decay = replay_mixer(mixer, pool.mamba2_layer_cache(layer_id), norm(x), batch.cu_seqlens,
                                      batch.tail_lens, batch.mamba_slots, chunk_size, last)
        batch.log_survival = torch.maximum(batch.log_survival, tail_log_survival(log_decay, batch))
        if last:
            return
        scale = getattr(layer, "residual_multiplier", 1.0)
        x = x + scale * _tp_reduced(out, mixer.out_proj)
        if granite:
            x = x + scale * _tp_reduced(_granite_ffn(layer, layer.post_attention_layernorm(x)), mixer.out_proj)


def replay_kda_group(model, pool, group, x: torch.Tensor, batch: ReplayBatch) -> None:
    """A Kimi Linear group, its KDA layers in order (`replay_kda`); the last one's mixer output and feed-forward feed
    nothing the states depend on."""
    for layer_id in group.recurrent_layers:
        layer = model.layers[layer_id]
        out, log_decay = replay_kda_mixer(layer.self_attn, pool.mamba2_layer_cache(layer_id), layer.input_layernorm(x),
                                          batch.cu_seqlens, batch.tail_lens, batch.mamba_slots)
        batch.log_survival = torch.maximum(batch.log_survival, tail_log_survival(log_decay, batch))
        if layer_id == group.recurrent_layers[-1]:
            return
        x = x + _tp_reduced(out, layer.self_attn.o_proj)
        x = x + _tp_reduced(layer.mlp(layer.post_attention_layernorm(x)), _reduction_owner(layer.mlp))


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


def replay_layer(layer, cache, x: torch.Tensor, batch: ReplayBatch, state_only: bool):
    """One GDN decoder layer over the packed tails; conv and recurrent states land in the requests' slots.
    Returns the next residual-stream value, or None when only the states were needed."""
    la = layer.linear_attn
    h = layer.input_layernorm(x)
    mixed, a, b, output = gdn_inputs(la, h)
    g, _ = gdn_gating(la.A_log, a, b, la.dt_bias)  # T x HV: cheap beside the layer
    batch.log_survival = torch.maximum(batch.log_survival, tail_log_survival(g[0], batch))
    core = replay_gdn_layer(mixed, a, b, la.attn.conv_weights, la.attn.bias, la.A_log, la.dt_bias, batch.cu_seqlens,
                            batch.mamba_slots, cache.conv[0], cache.temporal, state_only=state_only,
                            max_seqlen=max(batch.tail_lens), beta_scale=getattr(la, "beta_scale", 1.0))
    if state_only:
        return None
    x = x + output(core)
    return x + _tp_reduced(layer.mlp(layer.post_attention_layernorm(x)), _reduction_owner(layer.mlp))


def _reduction_owner(mlp):
    """The module whose `reduce_results` says whether the feed-forward output still lacks its TP sum: a MoE block
    (Qwen3.5-MoE, Qwen3-Next) carries the flag itself, a dense MLP on its down projection, Kimi's MoE on its experts
    (its shared expert's partial sum is added before the reduction, as in its layer)."""
    if hasattr(mlp, "reduce_results"):
        return mlp
    down = getattr(mlp, "down_proj", None)
    return down if down is not None else getattr(mlp, "experts", None)


def gdn_inputs(la, h: torch.Tensor):
    """The GDN module's pre-conv q | k | v [T, conv_dim], raw gates a, b [T, HV] and a function from the core
    output to the module's output, each through the model's own layers."""
    T = h.shape[0]
    if hasattr(la, "project"):  # OLMo-Hybrid (tailreplay_sglang.models): separate projections, g-projection gate
        mixed, a, b = la.project(h)
        return mixed, a, b, lambda core: la.output(core, h)
    qkvz, ba = la._forward_input_proj(h)
    q, k, v, z, b, a = la.fix_query_key_value_ordering(qkvz, ba)  # Qwen's interleaved layout of its projections
    mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)

    def output(core):
        dv = la.head_v_dim
        return _tp_reduced(la.out_proj(la.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(T, -1))[0], la.out_proj)

    return mixed, a.reshape(T, -1), b.reshape(T, -1), output


def _tp_reduced(partial: torch.Tensor, linear) -> torch.Tensor:
    """Qwen's output projection, MLP and MoE block are built with reduce_results=False: in the model's forward its
    layer communicator all-reduces their outputs across TP ranks. The replay calls them directly, so it reduces them itself;
    every rank replays the same batch at the same point (TP schedulers run in lockstep), so the collectives pair up.
    A no-op at TP 1 and for layers that reduce inside (OLMo-Hybrid's)."""
    if linear is None or getattr(linear, "reduce_results", True):
        return partial
    from sglang.srt.distributed.communication_op import tensor_model_parallel_all_reduce
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_world_size

    return tensor_model_parallel_all_reduce(partial) if get_tensor_model_parallel_world_size() > 1 else partial


def tail_log_survival(g: torch.Tensor, batch: ReplayBatch) -> torch.Tensor:
    """[n] max over heads of sum_t g_t over each tail, from the log-gates g [T, HV] of one layer."""
    lens = torch.tensor(batch.tail_lens, device=g.device)
    seq = torch.repeat_interleave(torch.arange(len(batch.tail_lens), device=g.device), lens)
    sums = torch.zeros(len(batch.tail_lens), g.shape[1], device=g.device).index_add_(0, seq, g)
    return sums.max(dim=1).values


def run_pending(runner, forward_batch, store: HiddenStore, pending: PendingReplays, config: TailReplayConfig,
                metrics=None) -> ReplayBatch | None:
    rows = pending.take(forward_batch.req_pool_indices.tolist(), list(forward_batch.extend_prefix_lens_cpu))
    for _, match, req in rows:  # what every hit reports, replayed or not; the pass below adds its figures
        visibility.record_hit(req, match.anchor, survival=None if match.exact else 1.0)
        if metrics is not None:
            metrics.observe_hit(match.exact)
    batch = plan(runner, forward_batch, rows, config) if rows else None
    if batch is None:
        return None
    start = time.perf_counter()
    run(runner, store, batch, config.h2d)
    seconds = time.perf_counter() - start
    survival = batch.log_survival.exp().tolist()
    for req, k, s in zip(batch.reqs, batch.tail_lens, survival):
        visibility.record_replay(req, k, seconds * 1e3, s)
    if metrics is not None:
        metrics.observe(len(batch.reqs), sum(batch.tail_lens), seconds)
    logger.info("Tail-Replay: %d request(s), %d token(s) replayed in %.1f ms", len(batch.tail_lens),
                sum(batch.tail_lens), seconds * 1e3)
    return batch
