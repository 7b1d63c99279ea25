"""transformers' `OlmoHybridConfig`, read exactly as transformers writes it, plus what SGLang's hybrid code asks of a
config (the same properties SGLang's own `Qwen3NextConfig` has)."""

from transformers.models.olmo_hybrid.configuration_olmo_hybrid import OlmoHybridConfig

from tailreplay_sglang.layout import FULL, LINEAR


class OlmoHybridSGLangConfig(OlmoHybridConfig):
    @property
    def layers_block_type(self) -> list[str]:
        return list(self.layer_types)

    @property
    def linear_layer_ids(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == LINEAR]

    @property
    def full_attention_layer_ids(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == FULL]

    @property
    def mamba2_cache_params(self):
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape, mamba2_state_dtype
        from sglang.srt.runtime_context import linear_attn_tp_size

        key_dim = self.linear_key_head_dim * self.linear_num_key_heads
        value_dim = self.linear_value_head_dim * self.linear_num_value_heads
        shape = Mamba2StateShape.create(
            tp_world_size=linear_attn_tp_size(),
            intermediate_size=value_dim,
            n_groups=self.linear_num_key_heads,
            num_heads=self.linear_num_value_heads,
            head_dim=self.linear_value_head_dim,
            state_size=self.linear_key_head_dim,
            conv_kernel=self.linear_conv_kernel_dim,
            conv_shard_groups=[key_dim, key_dim, value_dim],  # conv state = q | k | v, each head-sharded
        )
        return Mamba2CacheParams(shape=shape, layers=self.linear_layer_ids, dtype=mamba2_state_dtype(self))
