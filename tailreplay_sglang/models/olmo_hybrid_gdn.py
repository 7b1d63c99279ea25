"""SGLang's GDN attention backend with OLMo-Hybrid's beta = 2 sigmoid(b) (`linear_allow_neg_eigval`).

SGLang's GDN kernels compute beta = sigmoid(b) themselves. Prefill takes g and beta from one overridable step
(`_prefill_gates`), so scaling beta there keeps SGLang's conv, chunked kernel, state tracking and radix-cache
checkpoints as they are. Decode fuses the gating into the recurrent kernel, so a decode step here computes g and
beta first and runs the recurrent kernel that takes them explicitly (fla's `fused_recurrent_gated_delta_rule_update`
on GPU, `tailreplay_sglang.ops.gdn` on CPU). No other part of the backend changes.
"""

import torch

from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
from sglang.srt.utils import is_cpu


def beta_scale_of(hf_config) -> float:
    """2 when the checkpoint allows negative eigenvalues (transformers' default for OLMo-Hybrid), else 1."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return 2.0 if getattr(text, "linear_allow_neg_eigval", False) else 1.0


class ScaledBetaDecode:
    """Decode kernel: gating first (beta scaled), then the delta rule with explicit g and beta."""

    supports_packed_decode = False  # the packed kernel fuses sigmoid(b) too

    def __init__(self, beta_scale: float):
        self.beta_scale = beta_scale

    def decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc, **kwargs):
        if is_cpu():
            from tailreplay_sglang.ops import gdn

            return gdn.recurrent_gated_delta_rule_update(
                A_log, dt_bias, q, k, v, a, b, ssm_states, cache_indices, query_start_loc,
                use_qk_l2norm_in_kernel=True, beta_scale=self.beta_scale)
        from sglang.kernels.ops.attention.fla.fused_recurrent import fused_recurrent_gated_delta_rule_update
        from sglang.kernels.ops.attention.linear.fused_gdn_gating import fused_gdn_gating

        g, beta = fused_gdn_gating(A_log, a, b, dt_bias)
        return fused_recurrent_gated_delta_rule_update(
            q, k, v, g, beta * self.beta_scale, initial_state_source=ssm_states, initial_state_indices=cache_indices,
            cu_seqlens=query_start_loc, use_qk_l2norm_in_kernel=True)


class OlmoHybridGDNAttnBackend(GDNAttnBackend):
    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.beta_scale = beta_scale_of(model_runner.model_config.hf_config)
        if self.beta_scale != 1.0:
            self.kernel_dispatcher.decode_kernel = ScaledBetaDecode(self.beta_scale)
            self.kernel_dispatcher.supports_packed_decode = False

    def _prefill_gates(self, layer, a: torch.Tensor, b: torch.Tensor):
        g, beta = GDNAttnBackend._prefill_gates(layer, a, b)
        return g, beta if self.beta_scale == 1.0 else beta * self.beta_scale
