"""The replay pass: rebuild hit requests' recurrent states from a tail of their matched prefix, before their extend.

On a hit of m tokens a request's mamba slot holds either a copy of the anchor state kept at depth c
(`cache/component.py`: anchored, exact), and it replays [c, m), or a cleared state, and it replays the paper's tail
[m - k, m) with k = config.tail_len(m) (approximate unless k = m). Every group replays independently from its slot
state over those tokens: group 0 from the embeddings of the tokens, later groups from the hidden store; how a group
is replayed is its family's (`families/`). All hit requests of a prefill batch replay together as one varlen batch.

For a zero-init tail the pass also reports how much of the dropped prefix state could still count at m: the
largest, over recurrent layers and heads, of exp(sum of the log-decays over the tail). Each step multiplies the
state by its decay and a non-expansive update (for the delta rule, I - beta k k^T with unit-norm k and beta in
(0, 2]), so this bounds, in operator norm, the share of the true state at m - k that survives to m
(`tail_replay_state_survival`).
"""

import contextlib
import dataclasses
import logging
import time

import torch

from tailreplay_sglang import dp_attention, visibility
from tailreplay_sglang.architectures import decoder_stack
from tailreplay_sglang.cache.request import Match, PendingReplays
from tailreplay_sglang.config import TailReplayConfig
from tailreplay_sglang.families import Family, ReplayBatch
from tailreplay_sglang.families.base import token_embedding
from tailreplay_sglang.store.hidden_store import TOKENS, HiddenStore
from tailreplay_sglang.store.transfer import HostToDevice, pin

logger = logging.getLogger(__name__)


def replay_start(match: Match, config: TailReplayConfig) -> int:
    """First replayed position of a hit: its anchor, or the start of the zero-init tail."""
    if match.anchor is not None:
        return match.anchor
    return match.matched - config.tail_len(match.matched)


def plan(runner, pool_rows: list[int], rows: list[tuple[int, Match, object]],
         config: TailReplayConfig) -> ReplayBatch | None:
    pool = runner.req_to_token_pool
    spans, mamba_rows, lens, starts, reqs, resets, exact = [], [], [], [], [], [], True
    for row, match, req in rows:
        pool_idx = pool_rows[row]
        if match.reset:
            resets.append(pool_idx)
        start = replay_start(match, config)
        if start == match.matched:  # an anchor at the match end, or the paper's zero mode: nothing to replay
            continue
        spans.append(pool.req_to_token[pool_idx, start:match.matched].long())
        mamba_rows.append(pool_idx)
        lens.append(match.matched - start)
        starts.append(start)
        reqs.append(req)
        exact = exact and match.exact  # an approximate hit reports its survival bound
    device = pool.req_to_token.device
    if resets:  # before the replay, which starts from the slot's state (`retarget`)
        pool.mamba_pool.clear_slots(pool.translate_mamba_indices(pool.get_mamba_indices(_upload(resets, device))))
    if not spans:
        return None
    mamba_slots = pool.get_mamba_indices(_upload(mamba_rows, device)).long()
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return ReplayBatch(torch.cat(spans), pin(cu).to(device, non_blocking=True), mamba_slots, lens, reqs,
                       needs_survival=not exact, tail_starts=starts, cu_seqlens_cpu=cu, pool_rows=mamba_rows)


def _upload(values: list[int], device) -> torch.Tensor:
    """Host ints to the device without a sync (through pinned memory where CUDA is present)."""
    return pin(torch.tensor(values, dtype=torch.int64)).to(device, non_blocking=True)


@torch.no_grad()
def run(runner, store: HiddenStore, family: Family, batch: ReplayBatch, h2d_mode: str = "ovl") -> None:
    with own_token_counts():
        _run_groups(runner, store, family, batch, h2d_mode)


@contextlib.contextmanager
def own_token_counts():
    """The replay's MoE layers route their own packed tails. The model's forward context lends MoE the outer batch's
    count of real tokens (`moe_num_token_non_padded`, bound where SGLang pads batches for expert parallelism or
    DP attention), and TopK gives no expert to rows past it: the replay's rows past the batch's own extend would
    lose their MoE output. Inside, that count is unbound."""
    from sglang.srt.model_executor.forward_context import forward_context, get_forward_context, has_forward_context

    if not has_forward_context():
        yield
        return
    with forward_context(dataclasses.replace(get_forward_context(), moe_num_token_non_padded=_unbound)):
        yield


def _unbound():
    return None


def _run_groups(runner, store: HiddenStore, family: Family, batch: ReplayBatch, h2d_mode: str) -> None:
    model, pool = decoder_stack(runner.model), runner.req_to_token_pool
    embedding = token_embedding(model)
    dtype = embedding.weight.dtype
    h2d = HostToDevice(runner.device, h2d_mode)
    wait_for_loaded_rows(runner)
    inputs = store.fetch_tail(batch.kv_slots, h2d)  # every load launched up front (a no-op on the device tier)
    batch.kv_pool, batch.store = runner.token_to_kv_pool, store
    batch.log_survival = torch.full((len(batch.reqs),), float("-inf"), device=batch.mamba_slots.device)
    for group in store.layout.groups:
        key = group.first_layer if store.is_stored(group.first_layer) else TOKENS
        h2d.wait(key)  # group g's replay waits for its own input only, not for later groups' loads
        if key == TOKENS:  # group 0: fed by the embeddings of the tail tokens (some models scale them)
            x = embedding(inputs[key]) * getattr(model, "embedding_multiplier", 1.0)
        else:
            x = store.decode(inputs[key], dtype)
        family.replay_group(model, pool, group, x, batch)


def _plan_pending(runner, forward_batch, pending: PendingReplays, config: TailReplayConfig,
                  metrics) -> tuple[ReplayBatch | None, list[tuple[int, int]]]:
    """The batch's hits taken from `pending` and reported: the pass that rebuilds their states, or None, and every
    hit as (request-pool row, matched tokens)."""
    if not len(pending):
        return None, []
    pool_rows = pool_rows_of(forward_batch)
    rows = pending.take(pool_rows, list(forward_batch.extend_prefix_lens_cpu))
    for _, match, req in rows:  # what every hit reports, replayed or not; the pass below adds its figures
        visibility.record_hit(req, match.anchor, survival=None if match.exact else 1.0)
        if metrics is not None:
            metrics.observe_hit(match.exact)
    hits = [(pool_rows[row], match.matched) for row, match, _ in rows]
    return (plan(runner, pool_rows, rows, config) if rows else None), hits


def wait_for_loaded_rows(runner) -> None:
    """Under HiCache a hit's host pages come back layer by layer on the controller's stream, its hidden rows with
    the first layer's KV (`cache/hierarchy.py`). The replay waits for that layer only: the later layers' KV keeps
    loading while it runs, and each attention layer of the extend waits for its own (the paper's H2D overlap)."""
    counter = getattr(runner.token_to_kv_pool, "layer_transfer_counter", None)
    if counter is not None:
        counter.wait_until(0)


def pool_rows_of(forward_batch) -> list[int]:
    """The batch's request-pool rows, from the host copy SGLang keeps where it has one (no device read)."""
    rows = forward_batch.req_pool_indices_cpu
    return (rows if rows is not None else forward_batch.req_pool_indices).tolist()


def run_pending(runner, forward_batch, store: HiddenStore, family: Family, pending: PendingReplays,
                config: TailReplayConfig, metrics=None, replay_in_step: bool = True) -> ReplayBatch | None:
    """The replay pass of the batch's hits, before its extend. Under attention DP every rank comes here at every
    forward of a step in which any rank extends, and takes part in any rank's pass (`dp_attention.py`)."""
    exchanging = dp_attention.must_exchange(forward_batch, replay_in_step)
    if not len(pending) and not exchanging:  # no hit since the last forward: nothing to do, nothing read
        return None
    batch, hits = _plan_pending(runner, forward_batch, pending, config, metrics) \
        if forward_batch.forward_mode.is_extend() else (None, [])
    if exchanging:
        exchange = dp_attention.exchange_rows(sum(batch.tail_lens) if batch is not None else 0)
        if batch is None:
            if exchange.total:
                with own_token_counts():
                    family.participate(decoder_stack(runner.model), store.layout, exchange)
            return None
        batch.exchange = exchange
    if batch is None:
        family.on_hits(runner, store, hits)
        return None
    start = time.perf_counter()
    run(runner, store, family, batch, config.h2d)
    family.on_hits(runner, store, hits)
    seconds = time.perf_counter() - start
    # the one read a pass makes, and only when a zero-init tail has a bound to report
    survival = batch.log_survival.exp().tolist() if batch.needs_survival else [None] * len(batch.reqs)
    for req, k, s in zip(batch.reqs, batch.tail_lens, survival):
        visibility.record_replay(req, k, seconds * 1e3, s)
    if metrics is not None:
        metrics.observe(len(batch.reqs), sum(batch.tail_lens), seconds)
    logger.info("Tail-Replay: %d request(s), %d token(s) replayed in %.1f ms", len(batch.tail_lens),
                sum(batch.tail_lens), seconds * 1e3)
    return batch
