"""Every point where this package changes SGLang 0.5.23, in one table, and the code that registers them.

A row names the SGLang target, how it is changed, the function that does it and why that point. `kind` is a
`HookRegistry` hook type (before / after / around / replace: SGLang applies them when it loads plugins) or `call`
(a registration through SGLang's own registries, or a class constant no hook can set: run once by `register_*`).
Functions are `module:name` strings, resolved only when their table is registered, so that the launcher, which
registers the flags only, never imports the scheduler-side modules.

Tables, by where they are registered:
- `ALWAYS`: every SGLang process, with or without `--enable-tail-replay` (plugin entry point `tailreplay`), and
  `MODEL_LOADER` in those that already loaded SGLang's model loader;
- `RUNTIME` and `INTERVAL_ANCHORS`: scheduler processes with Tail-Replay enabled; rows marked `bound` get the
  process's `TailReplayRuntime` as their function's first parameter; the second table only with interval anchors;
  on a PD prefill server `PREFILL` too; a PD decode server registers `DECODE` alone (it never replays);
- `ELSEWHERE`: changes made outside `HookRegistry`, listed here so that this file is the whole picture: the
  `.pth` import hook the wheel installs into site-packages, and the capture's torch pre-hooks on the model.
`tests/test_hooks.py` checks that every target exists in the installed SGLang and that no other module registers a
hook.
SGLang on a CPU without AMX is changed by a separate package, the CPU port `sglang_cpu_compat`, with its own table,
entry point and `.pth`; this package never imports it.
"""

import functools
import pkgutil
import sys
from dataclasses import dataclass

_SRT = "sglang.srt"
_TOKENIZER = f"{_SRT}.managers.tokenizer_manager.TokenizerManager"
_RUNNER = f"{_SRT}.model_executor.model_runner.ModelRunner"
_CACHE = f"{_SRT}.mem_cache.unified_radix_cache.UnifiedRadixCache"
_CONTROLLER = f"{_SRT}.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController"
_STREAMER = f"{_SRT}.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
_PKG = "tailreplay_sglang"


@dataclass(frozen=True)
class Hook:
    target: str  # dotted path of what changes in SGLang
    kind: str  # before | after | around | replace (HookRegistry) | call (see the module docstring)
    fn: str  # "module:function" in this package
    why: str
    bound: bool = False  # the function takes the process's TailReplayRuntime first (RUNTIME / INTERVAL_ANCHORS)


ALWAYS = (
    Hook(f"{_SRT}.server_args.ServerArgs.add_cli_args", "after", f"{_PKG}.plugin:after_add_cli_args",
         "adds the Tail-Replay flags to SGLang's own parser"),
    Hook(f"{_SRT}.server_args.ServerArgs.from_cli_args", "around", f"{_PKG}.plugin:around_from_cli_args",
         "sees the raw Namespace (our flags are not ServerArgs fields): validates them (exit 2 before the model "
         "loads), hands the config to the spawned schedulers and sets radix_cache_backend before ServerArgs is built"),
    Hook(f"{_TOKENIZER}._validate_one_request", "before", f"{_PKG}.validation:validate_request",
         "every request path passes here and a ValueError becomes HTTP 400: a bad token id or PD bootstrap room "
         "must not kill the scheduler (stock 0.5.23 loses the server)"),
    Hook(f"{_TOKENIZER}._accumulate_request_meta_info", "around", f"{_PKG}.visibility:scalar_meta_info",
         "stock accumulates customized info into lists; our per-request keys become scalars in meta_info"),
    Hook(f"{_SRT}.utils.hf_transformers.common._CONFIG_REGISTRY", "call", f"{_PKG}.models:register_config",
         "OLMo-Hybrid (not in SGLang 0.5.23): get_config re-reads the checkpoint through our config class"),
    Hook(f"{_SRT}.configs.linear_attn_model_registry.register_linear_attn_model", "call",
         f"{_PKG}.models:register_linear_attention",
         "SGLang's route for external hybrid models: OLMo-Hybrid becomes hybrid-SSM with our GDN backend"),
    Hook(f"{_SRT}.layers.linear.ColumnParallelBatchedLinear.__init__", "before",
         f"{_PKG}.models.kimi_linear:batched_linear_in_serving_dtype",
         "Kimi Linear's batched f/g projection is built in the checkpoint's dtype, not the serving one: any --dtype "
         "other than the checkpoint's fails at the first KDA forward"),
)

# Only where SGLang's model loader is already imported (the scheduler): resolving the target imports every model.
MODEL_LOADER = (
    Hook(f"{_SRT}.model_loader.utils.get_model_architecture", "before", f"{_PKG}.models:add_model_classes",
         "puts OLMo-Hybrid in ModelRegistry just before SGLang resolves an architecture (importing the registry "
         "imports every model, so only where the model loader is already loaded: the scheduler)"),
)

_REPORT_ROWS = (
    Hook(f"{_SRT}.managers.scheduler_components.internal_state.SchedulerInternalStateController"
         ".get_internal_state", "after", f"{_PKG}.pool_report:add_to_internal_state",
         "pool readback in /server_info (tail_replay_pools) for tests and the soak run", bound=True),
    Hook(f"{_CACHE}._evict", "after", f"{_PKG}.pool_report:count_evicted_tokens", "counts evicted tokens",
         bound=True),
    Hook(f"{_STREAMER}.has_additional_customized_info", "call", f"{_PKG}.lifecycle:enable_customized_info",
         "the ClassVar opt-in of SGLang's per-request output fields", bound=True),
    Hook(f"{_STREAMER}.build_additional_customized_info", "replace", f"{_PKG}.visibility:build_customized_info",
         "SGLang's extension point for per-request output fields (tail_replay_tokens, _ms, _exact, ...)"),
    Hook(f"{_STREAMER}.is_request_level_customized_info_key", "replace", f"{_PKG}.visibility:is_request_level_key",
         "our keys are emitted once per request, not per token"),
)

RUNTIME = (
    Hook(f"{_SRT}.mem_cache.registry.register_radix_cache_backend", "call", f"{_PKG}.lifecycle:register_cache_backend",
         "backend `tail_replay`: fails closed on an unsupported resolved configuration or a hook that did not apply "
         "(lifecycle.build_tree_cache), then SGLang's create_unified_radix_cache with our MAMBA component (matches "
         "at any token, copies the nearest anchor into a hit's slot)", bound=True),
    Hook(f"{_SRT}.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size", "around",
         f"{_PKG}.lifecycle:add_store_to_cell_size",
         "where the per-token cost that sizes the KV pool is computed: the device-tier store's bytes make fewer "
         "tokens fit instead of overrunning memory", bound=True),
    Hook(f"{_SRT}.mem_cache.hybrid_cache.hybrid_pool_assembler.build_kv_host_pool", "around",
         f"{_PKG}.lifecycle:share_hicache_size_with_hidden_rows",
         "where HiCache's KV host pool gets its share of --hicache-size: the hidden store's host twin, one row per "
         "KV host slot (cache/hierarchy.py), takes its part of that share, as SGLang's own sidecar pools do",
         bound=True),
    Hook(f"{_SRT}.mem_cache.memory_pool.HybridReqToTokenPool.copy_mamba_state", "around",
         f"{_PKG}.cache.anchor_copy:copy_without_load_wait",
         "the batch's copy-on-write from device anchors, which no load-back writes: stock's wait there for the last "
         "mamba layer's load held the replay until the KV had paged back"),
    Hook(f"{_CONTROLLER}._storage_hit_query", "around", f"{_PKG}.cache.storage_anchors:widen_stop_points",
         "a storage prefetch's hit query (its thread): a fetch that asked for a state past the exact budget takes "
         "every stored page and the deepest state within the budget of their end, or stops within the budget of the "
         "server's own anchor (stock's trailing-page rule stops only at a stored state)"),
    Hook(f"{_CONTROLLER}._sync_prefetch_hit_query", "around", f"{_PKG}.cache.storage_anchors:drop_unneeded_state",
         "the hit is agreed over ranks and no host slot is staged yet: a hit that needs no state reads none"),
    Hook(f"{_SRT}.managers.scheduler.Scheduler._prefetch_after_device_hit_loss", "around",
         f"{_PKG}.cache.hierarchy:keep_folded_match",
         "a hit folded to its anchor is shorter than the storage lookup's match by design, not by eviction: no "
         "storage re-query for it (SGLang re-queried each up to 8 times)"),
    Hook(f"{_CONTROLLER}._sync_trailing_keys", "around", f"{_PKG}.cache.storage_anchors:read_planned_state",
         "just before a prefetch reads its state: SGLang keys it by the hit's last page, the planned state may lie "
         "before it (a hit past the budget replays from the deepest state stored within the budget of its end)"),
    Hook(f"{_RUNNER}.alloc_memory_pool", "after", f"{_PKG}.lifecycle:create_store",
         "the KV pool's size is known (the store shares its index space) and the model is loaded (capture needs its "
         "layers); before CUDA graphs are captured", bound=True),
    Hook(f"{_SRT}.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute", "around",
         f"{_PKG}.lifecycle:flush_after_graph",
         "right after a decode (or verify) graph replays, outside it: the host tier's staged rows go to its "
         "write-back before the next forward writes (no Python runs inside a replayed graph)", bound=True),
    Hook(f"{_SRT}.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.execute", "around",
         f"{_PKG}.lifecycle:flush_after_graph",
         "the same after a prefill graph replays", bound=True),
    Hook(f"{_SRT}.mem_cache.memory_pool.HybridLinearKVPool.move_kv_cache", "after",
         f"{_PKG}.lifecycle:move_hidden_rows",
         "speculative decoding with a draft tree moves the accepted tokens' KV to other slots: their hidden rows "
         "follow", bound=True),
    Hook(f"{_SRT}.managers.scheduler_components.dp_attn.MLPSyncBatchInfo._get_local_tensor", "after",
         f"{_PKG}.dp_attention:mark_replay_in_sync_row",
         "under attention DP, the row of per-rank figures SGLang gathers at every step: a rank with a replay pending "
         "marks it, so every rank learns from SGLang's own gather whether the step needs the row exchange",
         bound=True),
    Hook(f"{_SRT}.managers.scheduler_components.dp_attn.MLPSyncBatchInfo.all_gather", "after",
         f"{_PKG}.dp_attention:note_replay_in_step",
         "the gathered rows, the same on every rank: whether any rank replays this step", bound=True),
    Hook(f"{_SRT}.managers.schedule_batch.ScheduleBatch.prepare_for_extend", "after",
         f"{_PKG}.lifecycle:mark_pending",
         "the first point where a matched Req has its request-pool row and final prefix_len: the hit becomes a "
         "pending replay, and the batch's interval anchors are planned", bound=True),
    Hook(f"{_SRT}.managers.scheduler.Scheduler.get_new_batch_prefill", "after",
         f"{_PKG}.lifecycle:release_staged_anchors",
         "the batch is formed and holds its copy-on-write sources: the anchors its hits were matched to (and those "
         "of hits not admitted) are released", bound=True),
    Hook(f"{_RUNNER}._maybe_execute_deferred_mamba_cow_and_clear", "after", f"{_PKG}.lifecycle:replay_after_clear",
         "SGLang zeroes new slots and copies device anchors into hits' slots here, on the forward stream: host "
         "anchors are copied in and the replay writes after that, before the extend reads the pool", bound=True),
) + _REPORT_ROWS

PREFILL = (
    Hook(f"{_SRT}.disaggregation.utils.MetadataBuffers.set_buf", "after", f"{_PKG}.disaggregation:relay_to_decode",
         "PD prefill: the request's last chunk is computed (its replay ran before it) and its aux metadata row, "
         "which the transfer copies to the decode server whole, is filled: our values go into its spare slots",
         bound=True),
)

DECODE = (
    Hook(f"{_SRT}.mem_cache.registry.register_radix_cache_backend", "call", f"{_PKG}.lifecycle:register_cache_backend",
         "backend `tail_replay` on a PD decode server: SGLang's own cache without the decode radix cache, else the "
         "KV-only, taint-aware one (cache/decode_component.py)", bound=True),
    Hook(f"{_SRT}.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req", "after",
         f"{_PKG}.disaggregation:take_relayed",
         "PD decode: the transfer is done and the request's aux row (with the prefill server's values) is still "
         "held: the values become the request's, streamed as a colocated server streams them", bound=True),
) + _REPORT_ROWS

INTERVAL_ANCHORS = (
    Hook(f"{_SRT}.layers.attention.linear.gdn_backend.causal_conv1d_fn", "around",
         f"{_PKG}.families.gdn:write_anchor_conv_states",
         "SGLang's prefill conv (every device): the planned anchors' conv states are the inputs before each offset, "
         "read before the conv updates the slots", bound=True),
    Hook(f"{_SRT}.layers.attention.linear.kernels.gdn_triton.chunk_gated_delta_rule", "around",
         f"{_PKG}.families.gdn:write_anchor_ssm_states",
         "SGLang's chunked GDN prefill (fla's Triton kernel, or the fallback's op): the states it returns for every "
         "64-token chunk hold the planned anchors' SSM states", bound=True),
    Hook(f"{_SRT}.layers.attention.linear.kda_backend.causal_conv1d_fn", "around",
         f"{_PKG}.families.kda:write_anchor_conv_states",
         "KDA's prefill conv (every device): as GDN's, the planned anchors' conv states are the inputs before each "
         "offset", bound=True),
    Hook(f"{_SRT}.layers.attention.linear.kernels.kda_triton.TritonKDAKernel.extend", "around",
         f"{_PKG}.families.kda:write_anchor_ssm_states",
         "KDA's chunked prefill (fla's Triton kernel, or the CPU op): asked for its per-chunk states when anchors "
         "are planned, which hold their SSM states", bound=True),
    Hook(f"{_SRT}.layers.attention.linear.lightning_backend.LightningAttentionBackend._linear_attention_entry",
         "around", f"{_PKG}.families.lightning:write_anchor_states",
         "Ling-2.5's lightning kernel call (every device): the planned anchors' states are a closed form of the state "
         "entering the extend, read before the kernel updates the slot, and the keys and values it gets", bound=True),
    Hook(f"{_SRT}.layers.attention.mamba.mamba.MambaMixer2.forward", "around",
         f"{_PKG}.families.mamba2:write_anchor_states",
         "every Mamba2 mixer's forward (every device): its scan returns the per-chunk states on a grid over the packed "
         "batch, which holds the planned anchors' SSM states; their conv states are the input rows before them",
         bound=True),
    Hook(f"{_SRT}.models.jet_nemotron.JetBlock.forward", "around", f"{_PKG}.families.jet:track_planned_extend",
         "Jet-Nemotron's JetBlock (every device): in a prefill with planned anchors, the two rows below learn the "
         "layer's conv pool and the batch layout", bound=True),
    Hook(f"{_SRT}.models.jet_nemotron.DynamicShortConvolution.forward", "around",
         f"{_PKG}.families.jet:write_anchor_conv_states",
         "JetBlock's dynamic conv: the planned anchors' windows are its raw value rows before each offset, read "
         "before JetBlock writes the slots' new windows", bound=True),
    Hook(f"{_SRT}.models.jet_nemotron.fused_recurrent_gated_delta_rule_update", "around",
         f"{_PKG}.families.jet:write_anchor_ssm_states",
         "JetBlock's delta rule, one token-serial call per layer with no per-chunk states: run in rounds cut at the "
         "planned anchors, whose states are copied out of the slots where their rounds end", bound=True),
    Hook(f"{_CACHE}.checkpoint_into_tree", "after", f"{_PKG}.lifecycle:insert_interval_anchors",
         "the request's KV is in the tree and its row holds the tree's indices: an anchor can be inserted at its "
         "depth without freeing anything as a duplicate", bound=True),
    Hook(f"{_CACHE}.on_release", "after", f"{_PKG}.lifecycle:drop_interval_anchors",
         "frees the interval anchors a released request never got into the tree", bound=True),
)

ELSEWHERE = (
    Hook("sys.meta_path (first): sglang.srt.entrypoints.engine.Engine.__init__, "
         "sglang.lang.backend.runtime_endpoint.Runtime.__init__", "import",
         "tailreplay_sglang_python_api.pth -> tailreplay_sglang.python_api:install",
         "ServerArgs is sealed at import and Engine loads plugins too late: the Tail-Replay keywords are taken off "
         "these two constructors"),
    Hook("the first layer of every group: its mixer or decoder layer (torch pre-hook) or its stage boundary's "
         "prepare (wrapped)", "capture",
         "tailreplay_sglang.capture (the family's install_capture, called by lifecycle.create_store)",
         "writes token ids and group input hiddens at out_cache_loc during every forward"),
)

HOOK_KINDS = ("before", "after", "around", "replace")


def resolve(hook: Hook):
    return pkgutil.resolve_name(hook.fn)


def register_table(table, runtime=None) -> None:
    """Register a table's rows with SGLang's HookRegistry (`call` rows run now); the CPU port registers its own
    table through this too, so that both read and apply alike."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for hook in table:
        fn = resolve(hook)
        if hook.bound:
            fn = functools.partial(fn, runtime)
        if hook.kind == "call":
            fn()
        else:
            HookRegistry.register(hook.target, fn, HookType[hook.kind.upper()])


def register_always() -> None:
    """Plugin `tailreplay`, every process; `MODEL_LOADER` where SGLang's model loader is already loaded."""
    register_table(ALWAYS)
    if all(hook.target.rpartition(".")[0] in sys.modules for hook in MODEL_LOADER):
        register_table(MODEL_LOADER)


def runtime_tables(runtime) -> tuple[Hook, ...]:
    """The rows a runtime registers: a PD decode server's alone; else interval-anchor rows only with interval
    anchors, and the relay on a PD prefill server."""
    mode = runtime.config.disaggregation_mode
    if mode == "decode":
        return DECODE
    return (RUNTIME + (INTERVAL_ANCHORS if runtime.interval_anchors is not None else ())
            + (PREFILL if mode == "prefill" else ()))


def register_runtime(runtime) -> None:
    """Scheduler process with Tail-Replay enabled: the `bound` rows get its runtime."""
    register_table(runtime_tables(runtime), runtime)


def verify_applied(runtime, patched=None) -> None:
    """Raise unless every HookRegistry row the runtime registered took effect (SGLang only logs a failure)."""
    if patched is None:
        from sglang.srt.plugins.hook_registry import HookRegistry

        patched = HookRegistry._patched
    missing = [hook.target for hook in runtime_tables(runtime)
               if hook.kind in HOOK_KINDS and hook.target not in patched]
    if missing:
        raise RuntimeError(f"Tail-Replay: {len(missing)} SGLang hook(s) did not apply (SGLang's log says why), so "
                           f"hits would not be replayed correctly: {', '.join(missing)}")
