"""RoPE without scaling on SGLang's CPU engine. `get_rope_wrapper` sends every CPU rotary embedding to
`get_rope_cpu`, which builds DeepSeek-YaRN embeddings only and asserts a `rope_scaling` dict: a model that asks the
wrapper for plain RoPE (Ling-2.5's lightning layers, `rope_scaling` null or of type default) cannot be built on a
CPU. The `around` row of `hooks.CPU_ENGINE` gives plain RoPE `get_rope`'s embedding, whose CPU forward is torch
without AMX. Ling-2.5's MLA then pins its embedding to the CUDA kernel (`native_mla_rope` undoes that)."""


def plain_rope_without_scaling(original, head_size, rotary_dim, max_position, base, is_neox_style=True,
                               rope_scaling=None, dtype=None, partial_rotary_factor=1.0, device=None):
    kind = None if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind not in (None, "default"):  # transformers 5 writes a null rope_scaling as {"rope_type": "default", ...}
        return original(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype,
                        partial_rotary_factor, device)
    from sglang.srt.layers.rotary_embedding.factory import get_rope

    return get_rope(head_size, rotary_dim, max_position, base, is_neox_style, None, dtype, partial_rotary_factor)


def native_mla_rope(result, mla, *args, **kwargs):
    """After Ling-2.5's `DsV3MLA.__init__`, which pins its rotary embedding to `forward_cuda` whenever the config has
    a rope_scaling (transformers 5 writes one for every config): the embedding's own device dispatch again."""
    mla.rotary_emb.__dict__.pop("forward", None)
    return result
