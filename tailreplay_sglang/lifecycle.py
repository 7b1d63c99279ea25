"""What Tail-Replay does at each step of a request's life in SGLang's scheduler process: the bodies of the runtime's
hooks. Each takes the process's `TailReplayRuntime` first; `hooks.py` binds it and registers them.

Lifecycle of a hit:
1. the radix cache matches any token boundary, gives the request a slot for the deepest kept state (anchor) within
   the exact budget, holds that anchor and marks the request (`cache/component.py`, `cache/anchor_copy.py`);
2. `ScheduleBatch.prepare_for_extend` (after): marked requests, now with a request-pool row and their final
   prefix length, become pending replays; the batch's interval anchors are planned (`mark_pending`);
3. `Scheduler.get_new_batch_prefill` (after): the batch holds its copy sources, so the anchors are released
   (`release_staged_anchors`);
4. `ModelRunner._maybe_execute_deferred_mamba_cow_and_clear` (after SGLang cleared the new slots and copied the
   device anchors into them): host anchors are copied in, the pending replays of the batch run as one varlen pass
   (`replay.py`), then the extend continues from the prefix;
5. during every forward the family's capture keeps the hidden store current (`capture.py`), and its hooks on the
   prefill kernels write the planned interval anchors (`families/`);
6. `checkpoint_into_tree` (after): the interval anchors enter the tree.
The hidden store is sized with the KV pool and charged to its per-token cell size, so fewer tokens fit.
"""

import contextlib
import logging

import torch

from tailreplay_sglang import dp_attention, hooks, replay, supported, visibility
from tailreplay_sglang.architectures import decoder_stack
from tailreplay_sglang.cache.component import create_tail_replay_cache
from tailreplay_sglang.cache.decode_component import create_decode_cache
from tailreplay_sglang.cache.host_anchors import HostAnchors
from tailreplay_sglang.cache.request import is_tainted, peek, retarget
from tailreplay_sglang.families import family_for
from tailreplay_sglang.layout import HybridLayout
from tailreplay_sglang.runtime import TailReplayRuntime
from tailreplay_sglang.store.hicache_pool import HiddenHostPool
from tailreplay_sglang.store.hidden_store import HiddenStore, Shard, bytes_per_token

logger = logging.getLogger(__name__)


def _hidden_dtype(runtime: TailReplayRuntime, model_config) -> torch.dtype:
    return runtime.config.hidden_torch_dtype(model_config.dtype)


def add_store_to_cell_size(runtime: TailReplayRuntime, original, configurator, kvc, num_layers):
    cell = original(configurator, kvc, num_layers)
    if runtime.config.hidden_tier == "host":  # the store is in host memory: the device pool keeps its size
        return cell
    layout = HybridLayout.from_hf_config(kvc.model_config.hf_config)
    shards = store_shard(runtime, kvc.model_config, layout.row_width).world
    extra = bytes_per_token(layout, _hidden_dtype(runtime, kvc.model_config), shards)
    logger.info("Tail-Replay: KV cell %d B/token + hidden store %d B/token (each row split over %d attention-TP "
                "ranks)", cell, extra, shards)
    return cell + extra


def store_shard(runtime: TailReplayRuntime, model_config, hidden_size: int) -> Shard:
    """This rank's part of the hidden store (`hidden_store.Shard`): 1/N of every row over the N attention-TP ranks,
    which replay the same batch from the same replicated residual stream. Whole rows where the user asks for them
    (`--tail-replay-store-tp replicate`), where the hidden size does not split evenly, and for MLA models with a
    HiCache storage backend: SGLang keys an MLA model's pages without the TP rank (its latent KV is replicated), so
    the ranks' parts would overwrite each other's."""
    from sglang.srt.runtime_context import get_memory, get_parallel

    try:
        parallel = get_parallel()
        world = parallel.attn_tp_size
    except (ValueError, RuntimeError):  # no parallel context published: outside a scheduler (tools, tests)
        return Shard()
    mla = getattr(getattr(model_config, "attention_arch", None), "name", "") == "MLA"
    if (world == 1 or hidden_size % world or runtime.config.store_tp == "replicate"
            or (mla and get_memory().hicache_storage_backend)):
        return Shard()
    return Shard(parallel.attn_tp_rank, world, parallel.attn_tp_group)


def share_hicache_size_with_hidden_rows(runtime: TailReplayRuntime, original, *args, **kwargs):
    """`--hicache-size` bounds the host memory of every HiCache pool. The hidden store's host twin has one row per
    KV host slot, so the KV host pool gets the part of its share that leaves room for those rows: its GB times
    kv / (kv + hidden) bytes per token, as SGLang divides the KV's share with a sparse indexer's host pool. Under
    `--hicache-ratio` (no size) the host pool is sized in tokens and the rows come on top."""
    host_size, kv_pool = kwargs.get("host_size"), kwargs.get("kv_pool")
    if runtime.store is not None and host_size and kwargs.get("pool_label", "kv") == "kv":
        sizes = kv_pool.get_kv_size_bytes()
        kv = (sum(sizes) if isinstance(sizes, tuple) else sizes) / kv_pool.size
        hidden = HiddenHostPool.bytes_per_slot(runtime.store)
        kwargs["host_size"] = host_size * kv / (kv + hidden)
        logger.info("Tail-Replay: HiCache KV host pool gets %.3f of %.3f GB (KV %.0f B/token, hidden rows %d B/token)",
                    kwargs["host_size"], host_size, kv, hidden)
    return original(*args, **kwargs)


def create_store(runtime: TailReplayRuntime, result, runner, *args, **kwargs):
    if getattr(runner, "is_draft_worker", False):
        return result
    layout = HybridLayout.from_hf_config(runner.model_config.hf_config)
    model = decoder_stack(runner.model)
    runtime.family = family_for(layout)
    runtime.family.bind(model, layout)  # fails the start-up on a model internal this SGLang lacks
    num_slots = runner.token_to_kv_pool.size + runner.token_to_kv_pool.page_size  # slot 0 is SGLang's padding
    tier = runtime.config.hidden_tier or "device"  # the launcher resolves the default (plugin._hidden_tier)
    runtime.store = HiddenStore(layout, num_slots, _hidden_dtype(runtime, runner.model_config), runner.device, tier,
                                store_shard(runtime, runner.model_config, layout.row_width),
                                staging_rows=graph_staging_rows(runner) if tier == "host" else 0)
    runtime.kv_pool = runner.token_to_kv_pool
    runtime.family.install_capture(model, runtime.store)
    _log_anchor_bytes(runtime, runner)
    if runtime.config.host_anchors:
        runtime.host_anchors = HostAnchors(runner.req_to_token_pool.mamba_pool, runtime.config.host_anchors)
        logger.info("Tail-Replay host anchors: %d states in host memory, %.1f MiB", runtime.config.host_anchors,
                    runtime.host_anchors.nbytes / 2**20)
    from sglang.srt.runtime_context import get_observability

    if get_observability().enable_metrics:
        runtime.metrics = visibility.ReplayMetrics()
    return result


def graph_staging_rows(runner) -> int:
    """The host tier's staging rows on this runner (`store/staging.py`): 0 off CUDA, where nothing is captured."""
    if not str(runner.device).startswith("cuda"):
        return 0
    from sglang.srt.runtime_context import get_exec

    return staging_rows_for(get_exec().graph.cuda_graph_config, runner.decode_num_tokens_per_req())


def staging_rows_for(graph_config, decode_tokens_per_req: int) -> int:
    """The most rows one replayed CUDA graph writes: a decode graph's largest batch times its tokens per request (a
    verify's draft tokens), or a prefill graph's largest token bucket; 0 with every phase eager. A graph that
    captures more fails its capture, at start-up."""
    rows = 0
    for phase, per_row in (("decode", decode_tokens_per_req), ("prefill", 1)):  # prefill buckets count tokens
        graph = getattr(graph_config, phase)
        if getattr(graph.backend, "value", graph.backend) == "disabled":
            continue
        largest = max(graph.bs) if graph.bs else graph.max_bs
        if not largest:  # the scheduler's config has its buckets; a launcher-side one may not yet
            raise ValueError(f"the {phase} CUDA graph config has no batch sizes to size the host tier's staging by")
        rows = max(rows, largest * per_row)
    return rows


def flush_after_graph(runtime: TailReplayRuntime, original, graph_runner, forward_batch, *args, **kwargs):
    """After a replayed CUDA graph, outside it: what its capture points staged goes to the host tier's write-back,
    before the next forward writes (`HiddenStore.flush_staging`). Draft models capture nothing."""
    output = original(graph_runner, forward_batch, *args, **kwargs)
    store, loc = runtime.store, getattr(forward_batch, "out_cache_loc", None)
    staged = store is not None and store.staging is not None and loc is not None
    if staged and not getattr(getattr(graph_runner, "model_runner", None), "is_draft_worker", False):
        store.flush_staging(loc.shape[0])
    return output


def move_hidden_rows(runtime: TailReplayRuntime, result, pool, tgt_loc, src_loc, *args, **kwargs):
    """After the target's KV pool moved accepted draft tokens' KV (a draft tree: NGRAM, EAGLE topk > 1), their
    hidden rows follow, so that a later hit replays what was committed. Not for the draft model's own pool."""
    if runtime.store is not None and pool is runtime.kv_pool and tgt_loc.numel():
        runtime.store.move(tgt_loc, src_loc)
    return result


def anchor_bytes(pool) -> int:
    """Bytes of one mamba slot (conv + SSM state of every recurrent layer, `[layers, slots, ...]` each): what each
    anchor costs."""
    cache = pool.mamba_pool.mamba_cache
    return sum(t[:, 0].numel() * t.element_size() for t in (*cache.conv, cache.temporal))


def _log_anchor_bytes(runtime: TailReplayRuntime, runner) -> None:
    config = runtime.config
    if not config.anchored:
        logger.info("Tail-Replay: anchored replay off (--tail-replay-exact-budget 0): no recurrent state is kept")
        return
    per_anchor = anchor_bytes(runner.req_to_token_pool)
    interval = config.anchor_interval
    logger.info("Tail-Replay anchors: %d B per anchor (one mamba slot); interval %s%s", per_anchor,
                interval or "off", f" = {per_anchor / interval:.0f} B per cached token" if interval else "")


def mark_pending(runtime: TailReplayRuntime, result, batch, *args, **kwargs):
    replayed_hits = []
    for req in batch.reqs:
        state = peek(req)
        if state is None or state.match is None:
            continue
        match, state.match = state.match, None
        if req.prefix_len > 0 and req.kv.req_pool_idx is not None:
            if match.matched != req.prefix_len:
                clean = not is_tainted(batch.tree_cache.tree_core.node_by_id(req.last_node))
                match = retarget(match, req.prefix_len, clean, runtime.config)
                state.exact = match.exact and not state.emitted_approximate
                logger.debug("Tail-Replay: %s planned for %d tokens, extends from %d: %s", req.rid,
                             match.matched, req.prefix_len, match)
            runtime.pending.add(int(req.kv.req_pool_idx), match, req)
            if match.anchor != match.matched:
                replayed_hits.append(req)
    if runtime.interval_anchors is not None:
        if runtime.family is not None and not runtime.family.anchor_at_replay_end:
            replayed_hits = []
        runtime.interval_anchors.plan(batch.reqs, batch.req_to_token_pool, batch.tree_cache, replayed_hits)
    return result


def release_staged_anchors(runtime: TailReplayRuntime, plan, scheduler, *args, **kwargs):
    batch = plan.batch_to_run
    runtime.staged_anchors.release(scheduler.tree_cache, runtime.host_anchors, batch.reqs if batch is not None else ())
    return plan


def insert_interval_anchors(runtime: TailReplayRuntime, result, cache, req, *args, **kwargs):
    runtime.interval_anchors.commit(cache, req)
    return result


def drop_interval_anchors(runtime: TailReplayRuntime, result, cache, req, *args, **kwargs):
    runtime.interval_anchors.drop(cache.req_to_token_pool, req)
    return result


def replay_after_clear(runtime: TailReplayRuntime, result, runner, forward_batch, *args, **kwargs):
    """The batch's replays, before its extend. Interval anchors are paused meanwhile: a replay that goes through a
    hooked kernel runs on the same slots as the extend the anchors are planned for."""
    if str(runner.device).startswith("cuda"):
        # The stream forwards run on: the runner's forward stream under the overlap scheduler, the scheduler's own
        # stream without it. Host-anchor saves, made while scheduling, go there too (`component.on_forward_stream`).
        runtime.forward_stream = torch.cuda.current_stream()
    if runtime.store is None or getattr(runner, "is_draft_worker", False):
        return result  # a draft model's forwards replay nothing: its MTP layers keep no recurrent state
    if not forward_batch.forward_mode.is_extend():
        if dp_attention.must_exchange(forward_batch, runtime.replay_in_step):  # another rank's pass: take part
            replay.run_pending(runner, forward_batch, runtime.store, runtime.family, runtime.pending,
                               runtime.config, runtime.metrics, runtime.replay_in_step)
        return result
    runtime.staged_anchors.restore_host(runtime.host_anchors, runner.req_to_token_pool)
    anchors = runtime.interval_anchors
    with anchors.paused() if anchors is not None else contextlib.nullcontext():
        replay.run_pending(runner, forward_batch, runtime.store, runtime.family, runtime.pending, runtime.config,
                           runtime.metrics, runtime.replay_in_step)
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
    Tail-Replay supports (`supported.py`). On a PD decode server: SGLang's own cache without the decode radix cache,
    else the KV-only, taint-aware one (`cache/decode_component.py`)."""
    supported.check_resolved(ctx.server_args)
    if runtime.config.decode_only:
        hooks.verify_applied(runtime)
        if ctx.server_args.disable_radix_cache:
            from sglang.srt.mem_cache.registry import default_radix_cache_factory

            return default_radix_cache_factory(ctx)
        return create_decode_cache(runtime, ctx)
    supported.check_speculative_family(runtime.family, ctx.server_args)
    supported.check_dp_attention_family(runtime.family, ctx.server_args)
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_exec

    supported.check_dp_attention_exchange(ctx.server_args, envs.SGLANG_SCHEDULER_SKIP_ALL_GATHER.get(),
                                          envs.SGLANG_OPT_MASK_DP_PAD_MOE.get())

    on_cuda = str(ctx.tp_worker.model_runner.device).startswith("cuda")
    if runtime.interval_anchors is not None:
        supported.check_anchor_graphs(runtime.family, get_exec().graph.cuda_graph_config, on_cuda=on_cuda)
        supported.check_anchor_prefill(runtime.family, getattr(ctx.tp_worker.model_runner, "linear_attn_backends",
                                                               None))
    hooks.verify_applied(runtime)
    return create_tail_replay_cache(runtime, ctx)
