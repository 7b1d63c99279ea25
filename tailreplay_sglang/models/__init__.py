"""Models SGLang 0.5.23 lacks, served through its own out-of-tree registration points. `hooks.py` (tables `ALWAYS`
and `MODEL_LOADER`) calls these in SGLang's processes, with or without `--enable-tail-replay`; nothing for the user
to do beyond installing the package.

- config: `_CONFIG_REGISTRY` (SGLang's model_type -> config class map; `get_config` re-reads a registered model_type
  through its class) gets our subclass of transformers' `OlmoHybridConfig`, which adds what SGLang's hybrid code
  asks a config for (layer ids, mamba cache shapes);
- linear attention: `register_linear_attn_model` (SGLang's documented route for external hybrid models) makes the
  model hybrid-SSM (mamba pools, radix cache) and names the GDN backend to build for it;
- model class: `ModelRegistry.models`, filled just before SGLang resolves an architecture.
"""

OLMO_HYBRID_ARCH = "OlmoHybridForCausalLM"


def register_config() -> None:
    from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY

    from tailreplay_sglang.models.olmo_hybrid_config import OlmoHybridSGLangConfig

    _CONFIG_REGISTRY[OlmoHybridSGLangConfig.model_type] = OlmoHybridSGLangConfig


def register_linear_attention() -> None:
    from sglang.srt.configs import linear_attn_model_registry as registry

    from tailreplay_sglang.models.olmo_hybrid_config import OlmoHybridSGLangConfig

    if any(spec.config_class is OlmoHybridSGLangConfig for spec in registry._LINEAR_ATTN_MODEL_REGISTRY):
        return  # load_plugins is idempotent per process, but a second call must not add a second spec
    registry.register_linear_attn_model(registry.LinearAttnModelSpec(
        config_class=OlmoHybridSGLangConfig,
        backend_class_name="tailreplay_sglang.models.olmo_hybrid_gdn.OlmoHybridGDNAttnBackend",
        arch_names=[OLMO_HYBRID_ARCH],
        uses_mamba_radix_cache=True,
        support_mamba_cache=True,
    ))


def add_model_classes(*args, **kwargs):
    """BEFORE hook on `model_loader.utils.get_model_architecture`."""
    from sglang.srt.models.registry import ModelRegistry

    from tailreplay_sglang.models.olmo_hybrid import OlmoHybridForCausalLM

    ModelRegistry.models.setdefault(OLMO_HYBRID_ARCH, OlmoHybridForCausalLM)
