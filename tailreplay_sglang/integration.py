"""Where Tail-Replay plugs into SGLang's scheduler process (registered by `plugin.register` when enabled).

Lifecycle of a hit:
1. the radix cache matches any token boundary, copies the deepest kept state (anchor) within the exact budget into
   the request's slot and marks the request (`cache.py`);
2. `ScheduleBatch.prepare_for_extend` (after): marked requests, now with a request-pool row and their final
   prefix length, become pending replays;
3. `ModelRunner._maybe_execute_deferred_mamba_cow_and_clear` (after SGLang cleared the new slots): the pending
   replays of the batch run as one varlen pass (`replay.py`), then the extend continues from the prefix;
4. during every forward the capture hooks keep the hidden store current (`capture.py`).
The hidden store is sized with the KV pool and charged to its per-token cell size, so fewer tokens fit.
"""

import logging
import os
import time

import torch

from tailreplay_sglang import anchors, capture, pool_report, replay, visibility
from tailreplay_sglang.cache import MATCH_ATTR, RADIX_CACHE_BACKEND, create_tail_replay_cache, is_exact
from tailreplay_sglang.config import TailReplayConfig
from tailreplay_sglang.hidden_store import HiddenStore, bytes_per_token
from tailreplay_sglang.layout import HybridLayout
from tailreplay_sglang.state import RuntimeState

logger = logging.getLogger(__name__)

# Fault injection for the reliability tests: hold every replay pass this long, so that aborts, evictions and new
# arrivals land while a replay is running. Never set in production.
FAULT_REPLAY_DELAY_ENV = "TAILREPLAY_FAULT_REPLAY_DELAY_S"


def _hidden_dtype(model_config) -> torch.dtype:
    return RuntimeState.config.hidden_torch_dtype(model_config.dtype)


def add_store_to_cell_size(original, configurator, kvc, num_layers):
    cell = original(configurator, kvc, num_layers)
    if RuntimeState.config.hidden_tier == "host":  # the store is in host memory: the device pool keeps its size
        return cell
    extra = bytes_per_token(HybridLayout.from_hf_config(kvc.model_config.hf_config), _hidden_dtype(kvc.model_config))
    logger.info("Tail-Replay: KV cell %d B/token + hidden store %d B/token", cell, extra)
    return cell + extra


def create_store(result, runner, *args, **kwargs):
    if getattr(runner, "is_draft_worker", False):
        return result
    layout = HybridLayout.from_hf_config(runner.model_config.hf_config)
    num_slots = runner.token_to_kv_pool.size + runner.token_to_kv_pool.page_size  # slot 0 is SGLang's padding
    tier = RuntimeState.config.hidden_tier or "device"  # the launcher resolves the default (plugin._hidden_tier)
    RuntimeState.store = HiddenStore(layout, num_slots, _hidden_dtype(runner.model_config), runner.device, tier)
    capture.install(runner.model.model.layers, RuntimeState.store)
    _log_anchor_bytes(runner, layout)
    from sglang.srt.runtime_context import get_observability

    if get_observability().enable_metrics:
        RuntimeState.metrics = visibility.ReplayMetrics()
    return result


def anchor_bytes(pool, layout: HybridLayout) -> int:
    """Bytes of one mamba slot (conv + SSM state of every GDN layer): what each anchor costs."""
    total = 0
    for layer_id in (i for g in layout.groups for i in g.gdn_layers):
        cache = pool.mamba2_layer_cache(layer_id)
        total += sum(c[0].numel() * c.element_size() for c in cache.conv)
        total += cache.temporal[0].numel() * cache.temporal.element_size()
    return total


def _log_anchor_bytes(runner, layout: HybridLayout) -> None:
    config = RuntimeState.config
    if not config.anchored:
        logger.info("Tail-Replay: anchored replay off (--tail-replay-exact-budget 0): no recurrent state is kept")
        return
    per_anchor = anchor_bytes(runner.req_to_token_pool, layout)
    interval = config.anchor_interval
    logger.info("Tail-Replay anchors: %d B per anchor (one mamba slot); interval %s%s", per_anchor,
                interval or "off", f" = {per_anchor / interval:.0f} B per cached token" if interval else "")


def mark_pending(result, batch, *args, **kwargs):
    replayed_hits = []
    for req in batch.reqs:
        match = getattr(req, MATCH_ATTR, None)
        if match is None:
            continue
        setattr(req, MATCH_ATTR, None)
        if req.prefix_len > 0 and req.kv.req_pool_idx is not None:
            RuntimeState.pending.add(int(req.kv.req_pool_idx), match, req)
            if match.anchor != match.matched:
                replayed_hits.append(req)
    if RuntimeState.interval_anchors is not None:
        RuntimeState.interval_anchors.plan(batch.reqs, batch.req_to_token_pool, batch.tree_cache, is_exact,
                                           replayed_hits)
    return result


def insert_interval_anchors(result, cache, req, *args, **kwargs):
    if RuntimeState.interval_anchors is not None:
        RuntimeState.interval_anchors.commit(cache, req)
    return result


def drop_interval_anchors(result, cache, req, *args, **kwargs):
    if RuntimeState.interval_anchors is not None:
        RuntimeState.interval_anchors.drop(cache.req_to_token_pool, req)
    return result


def replay_after_clear(result, runner, forward_batch, *args, **kwargs):
    if RuntimeState.store is not None and forward_batch.forward_mode.is_extend():
        state = RuntimeState
        ran = replay.run_pending(runner, forward_batch, state.store, state.pending, state.config, state.metrics)
        if ran is not None and RuntimeState.fault_replay_delay_s:
            time.sleep(RuntimeState.fault_replay_delay_s)
    return result


def register(config: TailReplayConfig) -> None:
    from sglang.srt.mem_cache.registry import register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    RuntimeState.config = config
    RuntimeState.fault_replay_delay_s = float(os.environ.get(FAULT_REPLAY_DELAY_ENV, "0"))
    register_radix_cache_backend(RADIX_CACHE_BACKEND, create_tail_replay_cache)
    _register_interval_anchors(config, HookRegistry, HookType)
    runner = "sglang.srt.model_executor.model_runner.ModelRunner"
    HookRegistry.register(
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
        add_store_to_cell_size, HookType.AROUND)
    HookRegistry.register(f"{runner}.alloc_memory_pool", create_store, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend", mark_pending,
                          HookType.AFTER)
    HookRegistry.register(f"{runner}._maybe_execute_deferred_mamba_cow_and_clear", replay_after_clear,
                          HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state",
        pool_report.add_to_internal_state, HookType.AFTER)
    HookRegistry.register("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._evict",
                          pool_report.EvictionCounter.count, HookType.AFTER)
    _register_meta_info(HookRegistry, HookType)


def _register_interval_anchors(config: TailReplayConfig, HookRegistry, HookType) -> None:
    if not (config.anchored and config.anchor_interval):
        return
    if not anchors.capture_available():
        logger.warning("Tail-Replay: --tail-replay-anchor-interval needs the torch GDN prefill ops (CPU without "
                       "sgl-kernel) for now; only request-end and chunk-end anchors are kept")
        return
    from tailreplay_sglang.cpu.sgl_kernel_shim import STATE_CHECKPOINTS

    RuntimeState.interval_anchors = anchors.IntervalAnchors(config.anchor_interval, STATE_CHECKPOINTS)
    cache = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
    HookRegistry.register(f"{cache}.checkpoint_into_tree", insert_interval_anchors, HookType.AFTER)
    HookRegistry.register(f"{cache}.on_release", drop_interval_anchors, HookType.AFTER)


def _register_meta_info(HookRegistry, HookType) -> None:
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    # A ClassVar opt-in of SGLang's customized-info extension point (no hook can set a class constant).
    SchedulerOutputStreamer.has_additional_customized_info = True
    streamer = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
    HookRegistry.register(f"{streamer}.build_additional_customized_info", visibility.build_customized_info,
                          HookType.REPLACE)
    HookRegistry.register(f"{streamer}.is_request_level_customized_info_key", visibility.is_request_level_key,
                          HookType.REPLACE)
