"""What SGLang's `extra_buffer` mamba strategy needs from the CPU engine, in torch.

SGLang 0.5.23 resolves `--mamba-radix-cache-strategy auto` to `extra_buffer` on every GPU (the overlap scheduler is
on by default there), and refuses it on a CPU: `arg_groups/mamba_hook._platform_supports_mamba_cache_extra_buffer`
lists GPU platforms only. What the strategy actually needs from a device is small, and `hooks.CPU_ENGINE` supplies
it on a CPU without AMX:

- the platform answer (`platform_supports_extra_buffer`);
- per-chunk states from the chunked GDN prefill: `_track_mamba_state_extend` copies `h[track_ssm_h_src]`, the state
  entering a 64-token chunk, into a track slot (the fallback's op returns them, as fla's kernel does:
  `sgl_kernel_shim.chunk_gated_delta_rule_cpu`);
- conv states in the activation dtype: the extend copies a chunk-end conv window (`mixed_qkv`, activation dtype)
  into the conv pool by index_put, which fails unless the pool has that dtype; SGLang's default conv dtype is
  bfloat16 (`SGLANG_MAMBA_CONV_DTYPE`), what a GPU model runs in, but CPU models run in float32 or float16
  (`conv_dtype_follows_model`, only where the user has not set the variable);
- `Tensor.pin_memory` that does not raise: decode batches stage their track mask through pinned memory, and a
  CPU-only torch raises "Cannot access accelerator device" there; with no device to copy to, the tensor itself is
  what pinning would give (`pin_memory_is_identity`);
- the decode-side track copy, a Triton kernel on every device (`track_states`, `track_states_all_layers`): each
  tracked row's conv and SSM states are copied from its live slot into its track slot.
"""

from sglang_cpu_compat.env import default_mamba_conv_dtype


def platform_supports_extra_buffer() -> bool:
    """REPLACE of SGLang's platform check: the CPU engine's ops provide what the strategy reads."""
    return True


def pin_memory_is_identity() -> None:
    """`call` row: on a torch with no accelerator, `Tensor.pin_memory()` returns the tensor (it raises otherwise)."""
    import torch

    if torch.accelerator.is_available() or getattr(torch.Tensor.pin_memory, "__tailreplay__", False):
        return

    def pin_memory(self, device=None):
        return self

    pin_memory.__tailreplay__ = True
    torch.Tensor.pin_memory = pin_memory


# Models whose own forward writes its conv windows into the pool with an indexed assignment, which needs the pool's
# dtype: a float32 Jet-Nemotron over SGLang's bfloat16 conv pool raised "Index put requires the source and
# destination dtypes match" at its first prefill
_WRITES_WINDOWS_IN_MODEL_DTYPE = ("JetNemotronForCausalLM",)


def conv_dtype_follows_model(runner, *args, **kwargs):
    """BEFORE `ModelRunner.alloc_memory_pool`: under extra_buffer, and for the models above, unless
    `SGLANG_MAMBA_CONV_DTYPE` is set, the conv pool takes the model's dtype (SGLang reads the variable when it builds
    the pool, just after this)."""
    from sglang.srt.runtime_context import get_exec

    architectures = getattr(runner.model_config.hf_config, "architectures", None) or ()
    # SGLang's resolved strategy (`auto` is resolved by now)
    if get_exec().mamba.enable_mamba_extra_buffer or set(architectures) & set(_WRITES_WINDOWS_IN_MODEL_DTYPE):
        default_mamba_conv_dtype(str(runner.model_config.dtype).removeprefix("torch."))


def track_states(conv_states, ssm_states, cache_indices, mamba_track_mask, mamba_track_indices, batch_size: int,
                 check_freed_slots: bool = False):
    """`track_mamba_states_if_needed` for one layer: pools are `[slots, ...]`."""
    _copy_tracked(conv_states.unsqueeze(0), ssm_states.unsqueeze(0), cache_indices, mamba_track_mask,
                  mamba_track_indices, batch_size, check_freed_slots)


def track_states_all_layers(conv_states_pool, ssm_states_pool, cache_indices, mamba_track_mask, mamba_track_indices,
                            batch_size: int, check_freed_slots: bool = False):
    """`track_mamba_states_all_layers`: pools are `[layers, slots, ...]`, one copy for every layer."""
    _copy_tracked(conv_states_pool, ssm_states_pool, cache_indices, mamba_track_mask, mamba_track_indices,
                  batch_size, check_freed_slots)


def _copy_tracked(conv, ssm, cache_indices, mask, track_indices, batch_size: int, check_freed_slots: bool):
    rows = mask[:batch_size].bool()
    src, dst = cache_indices[:batch_size][rows].long(), track_indices[:batch_size][rows].long()
    if check_freed_slots:  # the unified pool marks freed slots -1: skip those rows, as the kernel does
        keep = (src >= 0) & (dst >= 0)
        src, dst = src[keep], dst[keep]
    if src.numel():
        conv[:, dst] = conv[:, src]
        ssm[:, dst] = ssm[:, src]
