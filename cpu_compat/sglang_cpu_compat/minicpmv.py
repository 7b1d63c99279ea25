"""MiniCPM-V 4.6 / 4.7 on SGLang 0.5.23: the loader's shared-experts record lost by the model's wrapper."""


def keep_shared_experts_config(original, *args, **kwargs):
    """AROUND `model_loader.loader._initialize_model`: SGLang's `MiniCPMV` is a plain-object wrapper that forwards
    attribute reads to its version's module. The loader sets `shared_experts_config` on the wrapper, then returns
    `model.eval()`, which the wrapper forwards, so the runner holds the inner module without the record and the first
    warm-up raises AttributeError. The record is set on the inner module too. (Read: the loader and runners do the
    same on a GPU.)"""
    model = original(*args, **kwargs)
    inner = getattr(model, "minicpmv", None)
    if inner is not None and not hasattr(inner, "shared_experts_config"):
        inner.shared_experts_config = model.shared_experts_config
    return model
