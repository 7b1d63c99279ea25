"""Every point where the CPU port changes SGLang 0.5.23, in one table, and the code that registers it.

Rows are the plugin's `tailreplay_sglang.hooks.Hook` and are registered by its `register_table`, so that the port's
changes read, resolve and apply exactly as the plugin's do (its module docstring describes the kinds). `CPU_ENGINE`
is registered by the SGLang plugin entry point `sglang_cpu_compat` in every SGLang process, and only on SGLang's CPU
engine without AMX; `ELSEWHERE` lists the import hooks that `sglang_cpu_compat.pth` installs at interpreter start.
`tests/cpu_compat/test_compat_hooks.py` checks that every target exists in the installed SGLang.
"""

from sglang_cpu_compat.allocator import keep_freed_memory
from sglang_cpu_compat.env import default_mhc_torch_paths
from tailreplay_sglang.hooks import Hook, register_table

_SRT = "sglang.srt"
_RUNNER = f"{_SRT}.model_executor.model_runner.ModelRunner"
_FLA = "sglang.kernels.ops.attention.fla"
_PKG = "sglang_cpu_compat"

CPU_ENGINE = (
    Hook(f"{_FLA}.layernorm_gated.RMSNorm.forward", "replace", f"{_PKG}.triton_branches:rmsnorm_gated_forward",
         "Qwen3.5's GDN output norm goes to Triton on a CPU without AMX"),
    Hook(f"{_FLA}.fused_norm_gate.FusedRMSNormGated.forward", "replace",
         f"{_PKG}.triton_branches:fused_rmsnorm_gated_forward",
         "Qwen3-Next's GDN output norm goes to Triton on a CPU without AMX"),
    Hook(f"{_FLA}.layernorm_gated.layernorm_fn", "replace", f"{_PKG}.triton_branches:layernorm_fn",
         "Ling-2.5's lightning layers norm q and k per head with this Triton function, called directly"),
    Hook("sglang.kernels.ops.attention.linear.seg_la.seg_la_fwd", "replace", f"{_PKG}.lightning:seg_la_fwd",
         "Ling-2.5's lightning attention (prefill, decode, extra_buffer's tracking) is this Triton kernel"),
    Hook(f"{_FLA}.fused_recurrent.fused_recurrent_gated_delta_rule_update", "replace",
         f"{_PKG}.jet:fused_recurrent_update", "Jet-Nemotron's JetBlock delta rule (prefill and decode) is this "
         "Triton kernel"),
    Hook("sglang.kernels.ops.elementwise.elementwise.fused_gate_sigmoid_mul_add", "replace",
         f"{_PKG}.fused:gate_sigmoid_mul_add_", "the Qwen-MoE shared-expert gate goes to Triton"),
    Hook(f"{_SRT}.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend", "around",
         f"{_PKG}.extend_attention:sdpa_forward_extend",
         "stock pads the queries to the whole sequence (O(L x L) per hit); ours computes the new tokens' only"),
    Hook(f"{_SRT}.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend", "around",
         f"{_PKG}.speculative:verify_forward_extend",
         "speculative decoding's target verify carries no extend_* fields: drafts attend the prefix and their path"),
    Hook(f"{_SRT}.speculative.draft_utils.DraftBackendFactory._create_backend", "around",
         f"{_PKG}.speculative:torch_native_draft_backends",
         "the draft backend factory knows AMX but not torch_native on a CPU (draft extend, multi-step draft decode)"),
    Hook(f"{_SRT}.layers.attention.hybrid_linear_attn_backend.scatter_mamba_states_after_mtp_verify", "replace",
         f"{_PKG}.spec_commit:scatter_mamba_states_after_mtp_verify",
         "the commit after a verify (accepted and track steps' states into their slots) is a Triton scatter"),
    Hook(f"{_SRT}.layers.attention.hybrid_linear_attn_backend.fused_conv_window_scatter_with_mask", "replace",
         f"{_PKG}.spec_commit:scatter_with_mask", "the same scatter for conv windows alone"),
    Hook(f"{_SRT}.models.bailing_moe_nextn.BailingMoeForCausalLMNextN.set_embed_and_head", "replace",
         f"{_PKG}.speculative:share_embed_and_head",
         "Ling's NEXTN draft synchronizes CUDA after taking the target's embedding and LM head"),
    Hook(f"{_SRT}.models.deepseek_v2.DeepseekV2ForCausalLM.set_embed_and_head", "replace",
         f"{_PKG}.speculative:share_embed_and_head",
         "GLM-5.3-Flash's NEXTN draft (a DeepseekV2 model) synchronizes CUDA after taking the target's embedding"),
    Hook(f"{_SRT}.arg_groups.speculative_hook._disable_overlap_schedule_for_cpu", "replace",
         f"{_PKG}.speculative:keep_overlap_schedule",
         "SGLang turns overlap off for speculative decoding on a CPU: its GPU default (spec v2 + overlap) and "
         "extra_buffer_lazy then cannot run"),
    Hook(f"{_SRT}.managers.overlap_utils.gather_spec_extras", "replace", f"{_PKG}.spec_kernels:gather_spec_extras",
         "the overlap scheduler gathers each request's draft inputs with a Triton kernel"),
    Hook(f"{_SRT}.arg_groups.mamba_hook._platform_supports_mamba_cache_extra_buffer", "replace",
         f"{_PKG}.extra_buffer:platform_supports_extra_buffer",
         "SGLang's GPU default strategy (extra_buffer) lists GPU platforms only; the CPU ops give it what it reads"),
    Hook(f"{_RUNNER}.alloc_memory_pool", "before", f"{_PKG}.extra_buffer:conv_dtype_follows_model",
         "extra_buffer (and Jet-Nemotron's own forward) index-puts activations into the conv pool, which must then "
         "have the model's dtype (bfloat16 by default, what GPU models run in; CPU models run in float32 or float16)"),
    Hook(f"{_SRT}.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes", "around",
         f"{_PKG}.memory_profile:budget_from_own_load",
         "the KV budget charges the drop in free memory during the load as weights; on a CPU that is the machine's "
         "available RAM, so a neighbour starting at the same time counts too and can refuse the start: the drop is "
         "the loaded model's weights"),
    Hook("torch.Tensor.pin_memory", "call", f"{_PKG}.extra_buffer:pin_memory_is_identity",
         "extra_buffer stages each decode batch's track mask through pinned memory, which a CPU-only torch refuses"),
    Hook(f"{_SRT}.layers.attention.hybrid_linear_attn_backend.track_mamba_states_if_needed", "replace",
         f"{_PKG}.extra_buffer:track_states", "extra_buffer's decode-side state tracking is a Triton kernel"),
    Hook(f"{_SRT}.layers.attention.hybrid_linear_attn_backend.track_mamba_states_all_layers", "replace",
         f"{_PKG}.extra_buffer:track_states_all_layers",
         "extra_buffer's decode-side state tracking (all layers at once) is a Triton kernel"),
    Hook(f"{_SRT}.layers.attention.mamba.mamba.mamba_chunk_scan_combined", "call", f"{_PKG}.mamba2:install",
         "the Mamba2 mixer (Nemotron-H, Granite-4.0-H, Falcon-H1) binds its causal conv only on CUDA / NPU / XPU and "
         "its SSD scan and decode update are Triton: all six names bound to torch bodies"),
    Hook(f"{_SRT}.layers.attention.linear.kernels.kda_triton.chunk_kda", "call", f"{_PKG}.kda:install",
         "Kimi Linear's KDA kernel module imports its prefill and decode kernels only off CPU: both names bound "
         "to torch bodies"),
    Hook("sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_fn", "replace",
         f"{_PKG}.kda:causal_conv1d_fn", "KDA's prefill conv is this Triton kernel on every device"),
    Hook("sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_update", "replace",
         f"{_PKG}.short_conv:causal_conv1d_update",
         "LFM2's decode conv is this Triton kernel off CUDA (its prefill conv is the row above)"),
    Hook(f"{_SRT}.layers.rotary_embedding.factory.get_rope_cpu", "around", f"{_PKG}.rope:plain_rope_without_scaling",
         "SGLang's CPU rotary factory builds DeepSeek-YaRN only and asserts a rope_scaling: plain RoPE (Ling-2.5's "
         "lightning layers) takes the generic embedding"),
    Hook(f"{_SRT}.models.bailing_moe_linear.DsV3MLA.__init__", "after", f"{_PKG}.rope:native_mla_rope",
         "Ling-2.5's MLA pins its rotary embedding to the CUDA kernel whenever the config has a rope_scaling"),
    Hook(f"{_SRT}.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry", "call",
         f"{_PKG}.mla:register_mla_handler",
         "MLA (Kimi Linear's attention) on torch_native: SGLang's dispatch sends a fresh prefill down the MHA path, "
         "whose per-head keys torch_native does not keep; the absorbed path attends the cached latent"),
    Hook(f"{_SRT}.layers.moe.fused_moe_native.moe_forward_native", "around", f"{_PKG}.moe:scale_routed_output",
         "SGLang's CPU MoE drops the routed-expert scale (Kimi Linear's 2.446) that its GPU runner applies"),
    Hook(f"{_SRT}.models.nemotron_h.NemotronHMoE._forward_core_normal", "replace",
         f"{_PKG}.moe:nemotron_h_moe_core",
         "Nemotron-H's MoE router GEMM asks torch.mm for a float32 output dtype, which has no CPU kernel"),
    Hook(f"{_SRT}.mem_cache.pool_host.mha.MHATokenToKVPoolHost", "call", f"{_PKG}.kvcacheio:install",
         "HiCache's host pools (KV, MLA, mamba) import their copies from sgl_kernel.kvcacheio only on CUDA / ROCm / "
         "XPU: the `direct` io backend's three bound to torch gathers and scatters"),
    Hook(f"{_SRT}.arg_groups.hicache_hook.resolve_layout_io_compatibility", "before",
         f"{_PKG}.kvcacheio:direct_io_backend",
         "SGLang's default HiCache io backend (`kernel`) is CUDA-only: the server would start and its scheduler die at "
         "the first backup; the CPU engine takes `direct`"),
    Hook(f"{_SRT}.mem_cache.pool_host.mha.MHATokenToKVPoolHost.__init__", "around", f"{_PKG}.kvcacheio:unpinned",
         "HiCache's KV host pool pins its buffer (cudaHostRegister) by default, which a CPU-only torch refuses"),
    Hook(f"{_SRT}.mem_cache.pool_host.mla.MLATokenToKVPoolHost.__init__", "around", f"{_PKG}.kvcacheio:unpinned",
         "the same for the MLA host pool (Kimi Linear)"),
    Hook(f"{_SRT}.mem_cache.pool_host.mamba.MambaPoolHost.__init__", "around", f"{_PKG}.kvcacheio:unpinned",
         "the same for the mamba-state host pool (it does not call the base pool's __init__)"),
    Hook(f"{_SRT}.disaggregation.mooncake.conn.MooncakeKVSender.__init__", "after",
         f"{_PKG}.disaggregation:host_page_indices",
         "PD's prefill stages each chunk's page indices through pinned memory and a torch.cuda.Event for Mooncake's "
         "sender; on a CPU they are host tensors already (the numpy branch)"),
    Hook(f"{_SRT}.layers.attention.torch_native_backend.TorchNativeAttnBackend", "call",
         f"{_PKG}.dp_attention:install",
         "DP attention pads each rank's batch and asks the attention backend for the padded rows' sequence length "
         "(a CPU run: get_cpu_graph_seq_len_fill_value), which torch_native lacks"),
    Hook(f"{_SRT}.managers.data_parallel_controller.DataParallelController.event_loop", "replace",
         f"{_PKG}.dp_idle:event_loop",
         "the data-parallel controller busy-polls its socket and keeps a core busy while idle; it blocks in poll"),
    Hook(f"{_SRT}.managers.scheduler_components.idle_sleeper.IdleSleeper.maybe_sleep", "around",
         f"{_PKG}.dp_idle:sleep_briefly_under_dp_attention",
         "under attention DP an idle scheduler's one-second sleep stalls a peer's step (the request woke one group)"),
    Hook(f"{_SRT}.distributed.parallel_state.GroupCoordinator.reduce_scatterv", "around",
         f"{_PKG}.dp_attention:reduce_scatterv_on_cpu",
         "DP attention with expert parallelism scatters each layer's output back to the DP groups with pynccl's "
         "reduce_scatterv; on a CPU, SGLang's own all-reduce-and-slice form"),
    Hook(f"{_SRT}.layers.attention.qsa.qsa_indexer.QSAIndexer.forward_native", "replace",
         f"{_PKG}.qsa:indexer_forward_native",
         "Qwen3.8-Flash-Next's sparse-attention indexer has CUDA and XPU forwards only; both run its portable body"),
    Hook(f"{_SRT}.layers.attention.qsa.metadata.gather_qsa_compressed_keys", "replace",
         f"{_PKG}.qsa:gather_compressed_keys",
         "the indexer's prefill gathers its compressed keys with a Triton kernel"),
    Hook(f"{_SRT}.model_loader.loader._initialize_model", "around", f"{_PKG}.minicpmv:keep_shared_experts_config",
         "MiniCPM-V's wrapper loses the loader's shared-experts record at model.eval(): every runner's warm-up raises"),
    Hook(f"{_SRT}.arg_groups.model_hook.handle_model_specific_adjustments", "around",
         f"{_PKG}.glm5:launcher_without_cuda",
         "GLM-5.3-Flash's DSA launch steps ask CUDA for its device capability, which a CPU-only torch refuses"),
    Hook(f"{_SRT}.arg_groups.overrides._dsa_kv_cache_dtype_default", "replace", f"{_PKG}.glm5:kv_dtype_as_served",
         "the DSA launch forces a bfloat16 KV pool (refusing float32) where the CPU serves the model's dtype"),
    Hook(f"{_SRT}.layers.attention.dsa.dsa_indexer_kpool.IndexerKPool.forward_native", "replace",
         f"{_PKG}.glm5:indexer_forward_native",
         "GLM-5.3-Flash's DSA indexer has no CPU forward: no top-k indices, dense attention (exact to index_topk)"),
    Hook("sglang.kernels.ops.activation.silu_and_mul_clamp.silu_and_mul_clamp", "replace",
         f"{_PKG}.glm5:silu_and_mul_clamp", "GLM-5.3-Flash's clamped SwiGLU (swiglu_limit) is a CUDA JIT kernel"),
    Hook(f"{_SRT}.models.deepseek_v2.DeepseekV2MoE.__init__", "after", f"{_PKG}.glm5:mark_routed_scale_in_block",
         "DeepseekV2MoE scales its routed output itself off CUDA: the MoE row must not scale it twice"),
    Hook(f"{_SRT}.models.kimi_k3.KimiK3LinearModel.__init__", "around", f"{_PKG}.kimi_k3:model_without_streams",
         "Kimi K3 builds three CUDA streams for its layers unless on HIP; a CPU-only torch raises at construction"),
    Hook(f"{_SRT}.layers.attn_residual._mix_fused", "replace", f"{_PKG}.kimi_k3:mix_fused",
         "Kimi K3's attention-residual reads mix the bank with Triton score and combine kernels off CUDA and HIP"),
    Hook(f"{_SRT}.models.radio.RadioModel.forward", "around", f"{_PKG}.radio:pixels_in_tower_dtype",
         "Nemotron-H VL's processor hands the RADIO tower bfloat16 pixels; a float32 serve's first image raises"),
    Hook(f"{_SRT}.layers.attention.vision.VisionSdpaAttention.forward", "around",
         f"{_PKG}.radio:packed_images_masked_apart",
         "RADIO packs a request's images into one row; the CPU's SDPA vision attention masks it as a batch and raises"),
    Hook(f"{_SRT}.distributed.bootstrap._init_cpu_threads_env", "replace", f"{_PKG}.threads:bind_rank_threads",
         "SGLang applies each rank's resolved cores only through an AMX kernel; without it ranks spin on each "
         "other's cores"),
)

ELSEWHERE = (
    Hook("sys.meta_path (end): sgl_kernel, sgl_kernel.mamba, torchvision", "import",
         "sglang_cpu_compat.pth -> sglang_cpu_compat.fallback:install",
         "SGLang imports sgl_kernel on every device and its CPU build is not on PyPI: served from torch ops where "
         "the real package is missing, and only under SGLANG_USE_CPU_ENGINE=1"),
    Hook("sys.meta_path (first): torchvision", "import",
         "sglang_cpu_compat.pth -> sglang_cpu_compat.fallback:TorchvisionOpsFinder",
         "PyPI's torchvision is a CUDA build; its image transforms run on CPU torch, but its import needs two op "
         "schemas its C++ extension would define: defined in Python where that extension cannot load"),
)


def register() -> None:
    """Plugin `sglang_cpu_compat`: on SGLang's CPU engine, glibc malloc keeps what forwards free (`allocator.py`);
    the hooks only without AMX, so GPU and AMX runs keep SGLang's own kernels."""
    from sglang.srt.utils import cpu_has_amx_support, is_cpu

    if not is_cpu():
        return
    keep_freed_memory()
    default_mhc_torch_paths()
    if not cpu_has_amx_support():
        register_table(CPU_ENGINE)
