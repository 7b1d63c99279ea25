"""MLA (DeepSeek-style attention: Kimi Linear's full-attention layers) on SGLang's `torch_native` backend.

SGLang's MLA dispatch (`models/deepseek_common/attention_backend_handler.py`) has no handler for torch_native and
falls back to Triton's, which sends a fresh prefill down the MHA path. torch_native's extend reads keys and values
from the KV pool, which for MLA holds the compressed latent, not the per-head keys that path's queries match: the
first prefill fails on the shapes. A `call` row of `hooks.CPU_ENGINE` registers a handler that always takes the
absorbed path (queries folded through `kv_b_proj`, attention over the cached latent with one shared key head), as
decode does.
"""


def absorbed_mla(attn, forward_batch):
    """The torch_native handler of SGLang's MLA dispatch: the absorbed MLA path, for every forward mode."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    return AttnForwardMethod.MLA


def register_mla_handler() -> None:
    """`call` row: register `absorbed_mla` for torch_native."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

    AttentionBackendRegistry.register("torch_native", absorbed_mla)
