"""Models SGLang 0.5.23 lacks, served through its own out-of-tree registration points (see `register`)."""

import sys

OLMO_HYBRID_ARCH = "OlmoHybridForCausalLM"
_MODEL_LOADER = "sglang.srt.model_loader.utils"


def register() -> None:
    """Called by the `tailreplay` plugin in every SGLang process; nothing for the user to do beyond installing us.

    - config: `_CONFIG_REGISTRY` (SGLang's model_type -> config class map; `get_config` re-reads a registered
      model_type through its class) gets our subclass of transformers' `OlmoHybridConfig`, which adds what SGLang's
      hybrid code asks a config for (layer ids, mamba cache shapes);
    - linear attention: `register_linear_attn_model` (SGLang's documented route for external hybrid models) makes
      the model hybrid-SSM (mamba pools, radix cache) and names the GDN backend to build for it;
    - model class: `ModelRegistry.models`, filled just before SGLang resolves an architecture. Importing the registry
      imports every SGLang model (seconds of CPU), so it is done only where SGLang's model loader is already loaded
      (the scheduler), not in the launcher, which never loads a model.
    """
    from sglang.srt.configs.linear_attn_model_registry import LinearAttnModelSpec, register_linear_attn_model
    from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY

    from tailreplay_sglang.models.olmo_hybrid_config import OlmoHybridSGLangConfig

    if _CONFIG_REGISTRY.get(OlmoHybridSGLangConfig.model_type) is OlmoHybridSGLangConfig:
        return  # load_plugins is idempotent per process, but be safe against a second call
    _CONFIG_REGISTRY[OlmoHybridSGLangConfig.model_type] = OlmoHybridSGLangConfig
    register_linear_attn_model(LinearAttnModelSpec(
        config_class=OlmoHybridSGLangConfig,
        backend_class_name="tailreplay_sglang.models.olmo_hybrid_gdn.OlmoHybridGDNAttnBackend",
        arch_names=[OLMO_HYBRID_ARCH],
        uses_mamba_radix_cache=True,
        support_mamba_cache=True,
    ))
    if _MODEL_LOADER in sys.modules:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(f"{_MODEL_LOADER}.get_model_architecture", _add_model_classes, HookType.BEFORE)


def _add_model_classes(*args, **kwargs):
    from sglang.srt.models.registry import ModelRegistry

    from tailreplay_sglang.models.olmo_hybrid import OlmoHybridForCausalLM

    ModelRegistry.models.setdefault(OLMO_HYBRID_ARCH, OlmoHybridForCausalLM)
