"""What Tail-Replay does at each step of a request's life in SGLang's scheduler process: the bodies of the runtime's
hooks. Each takes the process's `TailReplayRuntime` first; `hooks.py` binds it and registers them.

Lifecycle of a hit:
1. the radix cache matches any token boundary, copies the deepest kept state (anchor) within the exact budget into
   the request's slot and marks the request (`cache/component.py`);
2. `ScheduleBatch.prepare_for_extend` (after): marked requests, now with a request-pool row and their final
   prefix length, become pending replays; the batch's interval anchors are planned (`mark_pending`);
3. `ModelRunner._maybe_execute_deferred_mamba_cow_and_clear` (after SGLang cleared the new slots): the pending
   replays of the batch run as one varlen pass (`replay.py`), then the extend continues from the prefix;
4. during every forward the capture hooks keep the hidden store current (`capture.py`), and the hooks on the
   prefill conv and chunked GDN write the planned interval anchors (`write_anchor_conv_states`,
   `write_anchor_ssm_states`);
5. `checkpoint_into_tree` (after): the interval anchors enter the tree.
The hidden store is sized with the KV pool and charged to its per-token cell size, so fewer tokens fit.
"""

import contextlib
import logging

import torch

from tailreplay_sglang import capture, hooks, replay, supported, visibility
from tailreplay_sglang.cache.component import MATCH_ATTR, create_tail_replay_cache, is_exact
from tailreplay_sglang.cache.host_anchors import HostAnchors
from tailreplay_sglang.layout import MAMBA2, HybridLayout
from tailreplay_sglang.runtime import TailReplayRuntime
from tailreplay_sglang.store.hidden_store import HiddenStore, bytes_per_token

logger = logging.getLogger(__name__)


def _hidden_dtype(runtime: TailReplayRuntime, model_config) -> torch.dtype:
    return runtime.config.hidden_torch_dtype(model_config.dtype)


def add_store_to_cell_size(runtime: TailReplayRuntime, original, configurator, kvc, num_layers):
    cell = original(configurator, kvc, num_layers)
    if runtime.config.hidden_tier == "host":  # the store is in host memory: the device pool keeps its size
        return cell
    layout = HybridLayout.from_hf_config(kvc.model_config.hf_config)
    extra = bytes_per_token(layout, _hidden_dtype(runtime, kvc.model_config))
    logger.info("Tail-Replay: KV cell %d B/token + hidden store %d B/token", cell, extra)
    return cell + extra


def create_store(runtime: TailReplayRuntime, result, runner, *args, **kwargs):
    if getattr(runner, "is_draft_worker", False):
        return result
    layout = HybridLayout.from_hf_config(runner.model_config.hf_config)
    num_slots = runner.token_to_kv_pool.size + runner.token_to_kv_pool.page_size  # slot 0 is SGLang's padding
    tier = runtime.config.hidden_tier or "device"  # the launcher resolves the default (plugin._hidden_tier)
    runtime.store = HiddenStore(layout, num_slots, _hidden_dtype(runtime, runner.model_config), runner.device, tier)
    runtime.forward_stream = getattr(runner, "forward_stream", None)
    capture.install(runner.model.model.layers, runtime.store)
    _log_anchor_bytes(runtime, runner, layout)
    if runtime.config.host_anchors:
        runtime.host_anchors = HostAnchors(runner.req_to_token_pool.mamba_pool, runtime.config.host_anchors)
        logger.info("Tail-Replay host anchors: %d states in host memory, %.1f MiB", runtime.config.host_anchors,
                    runtime.host_anchors.nbytes / 2**20)
    from sglang.srt.runtime_context import get_observability

    if get_observability().enable_metrics:
        runtime.metrics = visibility.ReplayMetrics()
    return result


def anchor_bytes(pool, layout: HybridLayout) -> int:
    """Bytes of one mamba slot (conv + SSM state of every GDN layer): what each anchor costs."""
    total = 0
    for layer_id in (i for g in layout.groups for i in g.recurrent_layers):
        cache = pool.mamba2_layer_cache(layer_id)
        total += sum(c[0].numel() * c.element_size() for c in cache.conv)
        total += cache.temporal[0].numel() * cache.temporal.element_size()
    return total


def _log_anchor_bytes(runtime: TailReplayRuntime, runner, layout: HybridLayout) -> None:
    config = runtime.config
    if not config.anchored:
        logger.info("Tail-Replay: anchored replay off (--tail-replay-exact-budget 0): no recurrent state is kept")
        return
    per_anchor = anchor_bytes(runner.req_to_token_pool, layout)
    interval = config.anchor_interval
    logger.info("Tail-Replay anchors: %d B per anchor (one mamba slot); interval %s%s", per_anchor,
                interval or "off", f" = {per_anchor / interval:.0f} B per cached token" if interval else "")


def mark_pending(runtime: TailReplayRuntime, result, batch, *args, **kwargs):
    replayed_hits = []
    for req in batch.reqs:
        match = getattr(req, MATCH_ATTR, None)
        if match is None:
            continue
        setattr(req, MATCH_ATTR, None)
        if req.prefix_len > 0 and req.kv.req_pool_idx is not None:
            runtime.pending.add(int(req.kv.req_pool_idx), match, req)
            if match.anchor != match.matched:
                replayed_hits.append(req)
    if runtime.interval_anchors is not None:
        if runtime.store is not None and runtime.store.layout.mixer == MAMBA2:
            replayed_hits = []  # the state at a replayed match end (offset 0) is not on the Mamba2 scan's grid
        runtime.interval_anchors.plan(batch.reqs, batch.req_to_token_pool, batch.tree_cache, is_exact,
                                      replayed_hits)
    return result


def write_anchor_conv_states(runtime: TailReplayRuntime, original, x, *args, **kwargs):
    """AROUND SGLang's prefill conv (`gdn_backend._convolve_prefill` passes the state arguments by keyword): the
    planned anchors' conv states, from its input, before it updates the slots."""
    runtime.interval_anchors.write_conv_states(x, kwargs["conv_states"], kwargs["cache_indices"],
                                               kwargs["query_start_loc"], kwargs["has_initial_state"])
    return original(x, *args, **kwargs)


def write_anchor_ssm_states(runtime: TailReplayRuntime, original, *args, **kwargs):
    """AROUND SGLang's chunked GDN prefill (`gdn_triton.TritonGDNKernel.extend` passes everything by keyword): the
    planned anchors' SSM states, from the per-chunk states it returns."""
    out = original(*args, **kwargs)
    runtime.interval_anchors.write_ssm_states(out[2], kwargs["initial_state"], kwargs["initial_state_indices"],
                                              kwargs["cu_seqlens"])
    return out


def write_anchor_kda_states(runtime: TailReplayRuntime, original, kernel, *args, **kwargs):
    """AROUND SGLang's KDA prefill kernel (`TritonKDAKernel.extend`, every device): the planned anchors' SSM states,
    from its per-chunk states, which it is asked for whenever an anchor is planned (extra_buffer asks for them
    too; the caller gets the shape it asked for)."""
    anchors = runtime.interval_anchors
    if not anchors.by_slot:
        return original(kernel, *args, **kwargs)
    wanted = kwargs.get("return_intermediate_states", False)
    out = original(kernel, *args, **dict(kwargs, return_intermediate_states=True))
    anchors.write_ssm_states(out[1], kwargs["ssm_states"], kwargs["cache_indices"], kwargs["query_start_loc"])
    return out if wanted else out[0]


def write_anchor_mamba2_states(runtime: TailReplayRuntime, original, mixer, *args, **kwargs):
    """AROUND SGLang's `MambaMixer2.forward` (every device; called with keywords): the planned anchors' states of
    this layer, from the per-chunk states the mixer's scan returned."""
    out = original(mixer, *args, **kwargs)
    runtime.interval_anchors.write_mamba2_states(mixer, kwargs["hidden_states"], kwargs["layer_cache"],
                                                 kwargs["metadata"], out[1])
    return out


def insert_interval_anchors(runtime: TailReplayRuntime, result, cache, req, *args, **kwargs):
    runtime.interval_anchors.commit(cache, req)
    return result


def drop_interval_anchors(runtime: TailReplayRuntime, result, cache, req, *args, **kwargs):
    runtime.interval_anchors.drop(cache.req_to_token_pool, req)
    return result


def replay_after_clear(runtime: TailReplayRuntime, result, runner, forward_batch, *args, **kwargs):
    """The batch's replays, before its extend. Interval anchors are paused meanwhile: a replay that goes through a
    hooked kernel (KDA's) runs on the same slots as the extend the anchors are planned for."""
    if runtime.store is not None and forward_batch.forward_mode.is_extend():
        anchors = runtime.interval_anchors
        with anchors.paused() if anchors is not None else contextlib.nullcontext():
            replay.run_pending(runner, forward_batch, runtime.store, runtime.pending, runtime.config, runtime.metrics)
    return result


def enable_customized_info(runtime: TailReplayRuntime) -> None:
    """The ClassVar opt-in of SGLang's per-request output fields (no hook can set a class constant)."""
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    SchedulerOutputStreamer.has_additional_customized_info = True


def register_cache_backend(runtime: TailReplayRuntime) -> None:
    import functools

    from sglang.srt.mem_cache.registry import register_radix_cache_backend

    from tailreplay_sglang.cache.component import RADIX_CACHE_BACKEND

    register_radix_cache_backend(RADIX_CACHE_BACKEND, functools.partial(build_tree_cache, runtime))


def build_tree_cache(runtime: TailReplayRuntime, ctx):
    """The radix-cache backend, built by each scheduler once every plugin's hooks are applied: the first point where
    it can be checked, failing closed, that they all took effect and that SGLang's resolved configuration is one
    Tail-Replay supports (`supported.py`)."""
    supported.check_resolved(ctx.server_args)
    hooks.verify_applied(runtime)
    return create_tail_replay_cache(runtime, ctx)
