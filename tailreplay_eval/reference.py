"""HF transformers reference for the models this project serves, runnable on CPU.

transformers prefers fla's Triton kernels for GDN layers whenever fla is importable, and Triton has no CPU driver,
so on CPU we point the modeling module back at its own pure-torch functions.
"""

import importlib

import torch

# modeling module -> names of GDN functions that transformers routes to fla when it is installed
_GDN_FUNCTIONS = {
    "transformers.models.qwen3_5.modeling_qwen3_5": (
        "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update"),
    "transformers.models.qwen3_next.modeling_qwen3_next": (
        "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update"),
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": (
        "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update"),
    "transformers.models.olmo_hybrid.modeling_olmo_hybrid": (
        "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update"),
    "transformers.models.kimi_linear.modeling_kimi_linear": (
        "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn", "causal_conv1d_update"),
}


def _torch_original(fn):
    """Follow functools.wraps chains back to the function defined in transformers itself."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def force_torch_gdn() -> None:
    for module_name, names in _GDN_FUNCTIONS.items():
        module = importlib.import_module(module_name)
        for name in names:
            if hasattr(module, name):
                setattr(module, name, _torch_original(getattr(module, name)))


def load_hf_model(model_path, dtype=torch.float32):
    """The checkpoint as an HF transformers model in eval mode (torch GDN path on CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    force_torch_gdn()
    config = AutoConfig.from_pretrained(model_path)
    is_vl = any(a.endswith("ForConditionalGeneration") for a in (config.architectures or []))
    loader = AutoModelForImageTextToText if is_vl else AutoModelForCausalLM
    return loader.from_pretrained(model_path, dtype=dtype).eval()


@torch.no_grad()
def greedy_generate(model, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Exactly max_new_tokens argmax tokens, end-of-text ones included, as the server's ignore_eos gives them.

    Not `model.generate(min_new_tokens=...)`: that masks the EOS logits until the minimum is reached, so where
    EOS is the argmax it picks the runner-up and differs from the server."""
    out = model(input_ids=torch.tensor([input_ids]), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(input_ids=torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@torch.no_grad()
def prompt_logprobs(model, input_ids: list[int]) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1."""
    ids = torch.tensor([input_ids])
    logits = model(input_ids=ids).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0].tolist()
