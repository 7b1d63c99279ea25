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
- `CPU_ENGINE`: SGLang on a CPU without AMX (plugin entry point `tailreplay_cpu_ops`);
- `ELSEWHERE`: changes made outside `HookRegistry`, listed here so that this file is the whole picture: the two
  `.pth` import hooks the wheel installs into site-packages, and the capture's torch pre-hooks on the model.
`tests/test_hooks.py` checks that every target exists in the installed SGLang and that no other module registers a
hook.
"""

import functools
import pkgutil
import sys
from dataclasses import dataclass

_SRT = "sglang.srt"
_TOKENIZER = f"{_SRT}.managers.tokenizer_manager.TokenizerManager"
_RUNNER = f"{_SRT}.model_executor.model_runner.ModelRunner"
_CACHE = f"{_SRT}.mem_cache.unified_radix_cache.UnifiedRadixCache"
_STREAMER = f"{_SRT}.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
_FLA = "sglang.kernels.ops.attention.fla"
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
    Hook(f"{_TOKENIZER}._validate_one_request", "before", f"{_PKG}.validation:validate_request_token_ids",
         "every request path passes here and a ValueError becomes HTTP 400: a bad token id must not kill the "
         "scheduler (stock 0.5.23 loses the server)"),
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

RUNTIME = (
    Hook(f"{_SRT}.mem_cache.registry.register_radix_cache_backend", "call", f"{_PKG}.lifecycle:register_cache_backend",
         "backend `tail_replay`: fails closed on an unsupported resolved configuration or a hook that did not apply "
         "(lifecycle.build_tree_cache), then SGLang's create_unified_radix_cache with our MAMBA component (matches "
         "at any token, copies the nearest anchor into a hit's slot)", bound=True),
    Hook(f"{_SRT}.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size", "around",
         f"{_PKG}.lifecycle:add_store_to_cell_size",
         "where the per-token cost that sizes the KV pool is computed: the device-tier store's bytes make fewer "
         "tokens fit instead of overrunning memory", bound=True),
    Hook(f"{_RUNNER}.alloc_memory_pool", "after", f"{_PKG}.lifecycle:create_store",
         "the KV pool's size is known (the store shares its index space) and the model is loaded (capture needs its "
         "layers); before CUDA graphs are captured", bound=True),
    Hook(f"{_SRT}.managers.schedule_batch.ScheduleBatch.prepare_for_extend", "after",
         f"{_PKG}.lifecycle:mark_pending",
         "the first point where a matched Req has its request-pool row and final prefix_len: the hit becomes a "
         "pending replay, and the batch's interval anchors are planned", bound=True),
    Hook(f"{_RUNNER}._maybe_execute_deferred_mamba_cow_and_clear", "after", f"{_PKG}.lifecycle:replay_after_clear",
         "SGLang zeroes new slots here on the forward stream: the replay writes after that clear and before the "
         "extend reads the pool", bound=True),
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

INTERVAL_ANCHORS = (
    Hook(f"{_SRT}.layers.attention.linear.gdn_backend.causal_conv1d_fn", "around",
         f"{_PKG}.lifecycle:write_anchor_conv_states",
         "SGLang's prefill conv (every device): the planned anchors' conv states are the inputs before each offset, "
         "read before the conv updates the slots", bound=True),
    Hook(f"{_SRT}.layers.attention.linear.kernels.gdn_triton.chunk_gated_delta_rule", "around",
         f"{_PKG}.lifecycle:write_anchor_ssm_states",
         "SGLang's chunked GDN prefill (fla's Triton kernel, or the fallback's op): the states it returns for every "
         "64-token chunk hold the planned anchors' SSM states", bound=True),
    Hook(f"{_SRT}.layers.attention.linear.kda_backend.causal_conv1d_fn", "around",
         f"{_PKG}.lifecycle:write_anchor_conv_states",
         "KDA's prefill conv (every device): as GDN's, the planned anchors' conv states are the inputs before each "
         "offset", bound=True),
    Hook(f"{_SRT}.layers.attention.linear.kernels.kda_triton.TritonKDAKernel.extend", "around",
         f"{_PKG}.lifecycle:write_anchor_kda_states",
         "KDA's chunked prefill (fla's Triton kernel, or the CPU op): asked for its per-chunk states when anchors "
         "are planned, which hold their SSM states", bound=True),
    Hook(f"{_SRT}.layers.attention.mamba.mamba.MambaMixer2.forward", "around",
         f"{_PKG}.lifecycle:write_anchor_mamba2_states",
         "every Mamba2 mixer's forward (every device): its scan returns the per-chunk states on a grid over the packed "
         "batch, which holds the planned anchors' SSM states; their conv states are the input rows before them",
         bound=True),
    Hook(f"{_CACHE}.checkpoint_into_tree", "after", f"{_PKG}.lifecycle:insert_interval_anchors",
         "the request's KV is in the tree and its row holds the tree's indices: an anchor can be inserted at its "
         "depth without freeing anything as a duplicate", bound=True),
    Hook(f"{_CACHE}.on_release", "after", f"{_PKG}.lifecycle:drop_interval_anchors",
         "frees the interval anchors a released request never got into the tree", bound=True),
)

CPU_ENGINE = (
    Hook(f"{_FLA}.layernorm_gated.RMSNorm.forward", "replace", f"{_PKG}.cpu.triton_branches:rmsnorm_gated_forward",
         "Qwen3.5's GDN output norm goes to Triton on a CPU without AMX"),
    Hook(f"{_FLA}.fused_norm_gate.FusedRMSNormGated.forward", "replace",
         f"{_PKG}.cpu.triton_branches:fused_rmsnorm_gated_forward",
         "Qwen3-Next's GDN output norm goes to Triton on a CPU without AMX"),
    Hook("sglang.kernels.ops.elementwise.elementwise.fused_gate_sigmoid_mul_add", "replace",
         f"{_PKG}.cpu.fused:gate_sigmoid_mul_add_", "the Qwen-MoE shared-expert gate goes to Triton"),
    Hook(f"{_SRT}.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend", "around",
         f"{_PKG}.cpu.extend_attention:sdpa_forward_extend",
         "stock pads the queries to the whole sequence (O(L x L) per hit); ours computes the new tokens' only"),
    Hook(f"{_SRT}.arg_groups.mamba_hook._platform_supports_mamba_cache_extra_buffer", "replace",
         f"{_PKG}.cpu.extra_buffer:platform_supports_extra_buffer",
         "SGLang's GPU default strategy (extra_buffer) lists GPU platforms only; the CPU ops give it what it reads"),
    Hook(f"{_RUNNER}.alloc_memory_pool", "before", f"{_PKG}.cpu.extra_buffer:conv_dtype_follows_model",
         "extra_buffer index-puts activations into the conv pool, which must then have the model's dtype (bfloat16 "
         "by default, what GPU models run in; CPU models run in float32 or float16)"),
    Hook("torch.Tensor.pin_memory", "call", f"{_PKG}.cpu.extra_buffer:pin_memory_is_identity",
         "extra_buffer stages each decode batch's track mask through pinned memory, which a CPU-only torch refuses"),
    Hook(f"{_SRT}.layers.attention.hybrid_linear_attn_backend.track_mamba_states_if_needed", "replace",
         f"{_PKG}.cpu.extra_buffer:track_states", "extra_buffer's decode-side state tracking is a Triton kernel"),
    Hook(f"{_SRT}.layers.attention.hybrid_linear_attn_backend.track_mamba_states_all_layers", "replace",
         f"{_PKG}.cpu.extra_buffer:track_states_all_layers",
         "extra_buffer's decode-side state tracking (all layers at once) is a Triton kernel"),
    Hook(f"{_SRT}.layers.attention.mamba.mamba.mamba_chunk_scan_combined", "call", f"{_PKG}.cpu.mamba2:install",
         "the Mamba2 mixer (Nemotron-H, Granite-4.0-H, Falcon-H1) binds its causal conv only on CUDA / NPU / XPU and "
         "its SSD scan and decode update are Triton: all six names bound to torch bodies"),
    Hook(f"{_SRT}.layers.attention.linear.kernels.kda_triton.chunk_kda", "call", f"{_PKG}.cpu.kda:install",
         "Kimi Linear's KDA kernel module imports its prefill and decode kernels only off CPU: both names bound "
         "to torch bodies"),
    Hook("sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_fn", "replace",
         f"{_PKG}.cpu.kda:causal_conv1d_fn", "KDA's prefill conv is this Triton kernel on every device"),
    Hook(f"{_SRT}.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry", "call",
         f"{_PKG}.cpu.mla:register_mla_handler",
         "MLA (Kimi Linear's attention) on torch_native: SGLang's dispatch sends a fresh prefill down the MHA path, "
         "whose per-head keys torch_native does not keep; the absorbed path attends the cached latent"),
    Hook(f"{_SRT}.layers.moe.fused_moe_native.moe_forward_native", "around", f"{_PKG}.cpu.moe:scale_routed_output",
         "SGLang's CPU MoE drops the routed-expert scale (Kimi Linear's 2.446) that its GPU runner applies"),
    Hook(f"{_SRT}.models.nemotron_h.NemotronHMoE._forward_core_normal", "replace",
         f"{_PKG}.cpu.moe:nemotron_h_moe_core",
         "Nemotron-H's MoE router GEMM asks torch.mm for a float32 output dtype, which has no CPU kernel"),
    Hook(f"{_SRT}.distributed.bootstrap._init_cpu_threads_env", "replace", f"{_PKG}.cpu.threads:bind_rank_threads",
         "SGLang applies each rank's resolved cores only through an AMX kernel; without it ranks spin on each "
         "other's cores"),
)

ELSEWHERE = (
    Hook("sys.meta_path (end): sgl_kernel, sgl_kernel.mamba, torchvision", "import",
         "tailreplay_sglang_cpu_fallback.pth -> tailreplay_sglang.cpu.fallback:install",
         "SGLang imports sgl_kernel on every device and its CPU build is not on PyPI: served from torch ops where "
         "the real package is missing, and only under SGLANG_USE_CPU_ENGINE=1"),
    Hook("sys.meta_path (first): torchvision", "import",
         "tailreplay_sglang_cpu_fallback.pth -> tailreplay_sglang.cpu.fallback:TorchvisionOpsFinder",
         "PyPI's torchvision is a CUDA build; its image transforms run on CPU torch, but its import needs two op "
         "schemas its C++ extension would define: defined in Python where that extension cannot load"),
    Hook("sys.meta_path (first): sglang.srt.entrypoints.engine.Engine.__init__, "
         "sglang.lang.backend.runtime_endpoint.Runtime.__init__", "import",
         "tailreplay_sglang_python_api.pth -> tailreplay_sglang.python_api:install",
         "ServerArgs is sealed at import and Engine loads plugins too late: the Tail-Replay keywords are taken off "
         "these two constructors"),
    Hook("the first GDN layer of every group: linear_attn (or the decoder layer)", "torch pre-hook",
         "tailreplay_sglang.capture:install (called by lifecycle.create_store)",
         "writes token ids and group input hiddens at out_cache_loc during every forward"),
)

HOOK_KINDS = ("before", "after", "around", "replace")


def resolve(hook: Hook):
    return pkgutil.resolve_name(hook.fn)


def _register(table, runtime=None) -> None:
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
    _register(ALWAYS)
    if all(hook.target.rpartition(".")[0] in sys.modules for hook in MODEL_LOADER):
        _register(MODEL_LOADER)


def runtime_tables(runtime) -> tuple[Hook, ...]:
    """The rows a runtime registers: interval-anchor rows only with interval anchors."""
    return RUNTIME + (INTERVAL_ANCHORS if runtime.interval_anchors is not None else ())


def register_runtime(runtime) -> None:
    """Scheduler process with Tail-Replay enabled: the `bound` rows get its runtime."""
    _register(runtime_tables(runtime), runtime)


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


def register_cpu_engine() -> None:
    """Plugin `tailreplay_cpu_ops`: only on SGLang's CPU engine without AMX, so GPU and AMX runs keep SGLang's own
    kernels."""
    from sglang.srt.utils import cpu_has_amx_support, is_cpu

    if is_cpu() and not cpu_has_amx_support():
        _register(CPU_ENGINE)
