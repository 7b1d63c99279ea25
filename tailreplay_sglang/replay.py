"""The replay pass: rebuild hit requests' GDN states from a tail of their matched prefix, before their extend.

On a hit of m tokens a request gets a cleared mamba slot and k = config.tail_len(m) tokens to replay. Every group
replays independently from a zero state over tokens [m - k, m): group 0 from the embeddings of those tokens, later
groups from the hidden store. Inside a group each GDN layer runs input norm -> projections -> conv -> GDN
(`kernels.replay.replay_gdn_layer`: Triton on GPU, the torch ops on CPU) with its states written into the request's
slot; the group's last GDN layer computes only its state (its outputs, norm, output projection and FFN feed nothing
the next group uses). All hit requests of a prefill batch replay together as one varlen batch.
"""

import logging
import time
from dataclasses import dataclass

import torch

from tailreplay_sglang import visibility
from tailreplay_sglang.config import TailReplayConfig
from tailreplay_sglang.hidden_store import TOKENS, HiddenStore
from tailreplay_sglang.kernels.replay import replay_gdn_layer
from tailreplay_sglang.transfer import HostToDevice

logger = logging.getLogger(__name__)


class PendingReplays:
    """Hit requests between prepare_for_extend and their forward, keyed by request-pool row."""

    def __init__(self):
        self._by_row: dict[int, tuple[int, object]] = {}

    def add(self, req_pool_idx: int, matched: int, req) -> None:
        self._by_row[req_pool_idx] = (matched, req)

    def take(self, req_pool_indices: list[int], prefix_lens: list[int]) -> list[tuple[int, int, object]]:
        """(batch row, matched length, req) of rows whose pending match is the prefix they extend from."""
        rows = []
        for row, (pool_idx, prefix) in enumerate(zip(req_pool_indices, prefix_lens)):
            matched, req = self._by_row.pop(pool_idx, (None, None))
            if matched is not None and matched == prefix and prefix > 0:
                rows.append((row, matched, req))
        # An entry lives from one prepare_for_extend to that batch's forward. One left over (its request was
        # aborted or retracted in between) must not be picked up by a later request on the same row.
        self._by_row.clear()
        return rows

    def __len__(self) -> int:
        return len(self._by_row)


@dataclass
class ReplayBatch:
    """One packed varlen replay: tails of all hit requests in a prefill batch."""

    kv_slots: torch.Tensor  # [sum k] KV slot of every replayed token
    cu_seqlens: torch.Tensor  # [n + 1]
    mamba_slots: torch.Tensor  # [n] each request's (cleared) mamba slot
    tail_lens: list[int]
    reqs: list


def plan(runner, forward_batch, rows: list[tuple[int, int, object]], config: TailReplayConfig) -> ReplayBatch | None:
    pool = runner.req_to_token_pool
    req_pool_indices = forward_batch.req_pool_indices
    spans, mamba_rows, lens, reqs = [], [], [], []
    for row, matched, req in rows:
        k = config.tail_len(matched)
        if k == 0:
            continue
        pool_idx = req_pool_indices[row]
        spans.append(pool.req_to_token[pool_idx, matched - k:matched].long())
        mamba_rows.append(pool_idx)
        lens.append(k)
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
    for group in store.layout.groups:
        key = group.first_layer if store.is_stored(group.first_layer) else TOKENS
        h2d.wait(key)  # group g's replay waits for its own input only, not for later groups' loads
        if key == TOKENS:  # group 0: fed by the embeddings of the tail tokens
            x = model.embed_tokens(inputs[key])
        else:
            x = inputs[key].to(dtype)
        for i, layer_id in enumerate(group.gdn_layers):
            last = i == len(group.gdn_layers) - 1
            x = replay_layer(model.layers[layer_id], pool.mamba2_layer_cache(layer_id), x, batch, state_only=last)


def replay_layer(layer, cache, x: torch.Tensor, batch: ReplayBatch, state_only: bool):
    """One GDN decoder layer over the packed tails; conv and recurrent states land in the requests' slots.
    Returns the next residual-stream value, or None when only the states were needed."""
    la = layer.linear_attn
    h = layer.input_layernorm(x)
    qkvz, ba = la._forward_input_proj(h)
    q, k, v, z, b, a = la.fix_query_key_value_ordering(qkvz, ba)  # the model's own layout of its projections
    T = h.shape[0]
    mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
    core = replay_gdn_layer(mixed, a.reshape(T, -1), b.reshape(T, -1), la.attn.conv_weights, la.attn.bias,
                            la.A_log, la.dt_bias, batch.cu_seqlens, batch.mamba_slots, cache.conv[0],
                            cache.temporal, state_only=state_only, max_seqlen=max(batch.tail_lens))
    if state_only:
        return None
    dv = la.head_v_dim
    out = la.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(T, -1)
    x = x + la.out_proj(out)[0]
    return x + layer.mlp(layer.post_attention_layernorm(x))


def run_pending(runner, forward_batch, store: HiddenStore, pending: PendingReplays, config: TailReplayConfig,
                metrics=None) -> ReplayBatch | None:
    rows = pending.take(forward_batch.req_pool_indices.tolist(), list(forward_batch.extend_prefix_lens_cpu))
    batch = plan(runner, forward_batch, rows, config) if rows else None
    if batch is None:
        return None
    start = time.perf_counter()
    run(runner, store, batch, config.h2d)
    seconds = time.perf_counter() - start
    for req, k in zip(batch.reqs, batch.tail_lens):
        visibility.record(req, k, seconds * 1e3)
    if metrics is not None:
        metrics.observe(len(batch.reqs), sum(batch.tail_lens), seconds)
    logger.info("Tail-Replay: %d request(s), %d token(s) replayed in %.1f ms", len(batch.tail_lens),
                sum(batch.tail_lens), seconds * 1e3)
    return batch
