"""OLMo-Hybrid (`OlmoHybridForCausalLM`) for SGLang 0.5.23, built from SGLang's own layers.

Follows transformers 5.19's `models/olmo_hybrid/modeling_olmo_hybrid.py`:
- full-attention layers are post-norm (OLMo-2/3 style): h += norm(attn(h)); h += norm(mlp(h)). q and k get an
  RMSNorm over all heads together (before the head split), then RoPE; RoPE is used only in these layers, and not at
  all when the config has no rope_theta (NoPE);
- GDN layers are pre-norm: h += gdn(norm(h)); h += mlp(norm(h)). The GDN has separate q/k/v/a/b/g projections, a
  SiLU depthwise conv over q | k | v (no bias), q/k l2-normalised in the kernel, beta = 2 sigmoid(b) when
  `linear_allow_neg_eigval` (see `olmo_hybrid_gdn.py`), and a gated RMSNorm (eps 1e-5, as transformers hard-codes)
  with SiLU of the g projection before the output projection.

The full-attention layers use `RadixAttention` and the GDN layers `RadixLinearAttention` with SGLang's hybrid
linear-attention backend and mamba pools, so the radix cache, chunked prefill and CUDA graphs work as for
Qwen3-Next. Linear layers are SGLang's tensor-parallel ones; like SGLang's OLMo-2, the all-head q/k norms gather
q and k across TP ranks first.

The residual stream is one tensor (no fused add + norm): with post-norm attention layers the stream value is
what each layer returns, which is also what Tail-Replay stores as a group's input (the GDN layer's own input).
"""

from functools import partial
from typing import Iterable, Optional, Tuple

import torch
from torch import nn

from sglang.kernels.ops.attention.fla.layernorm_gated import RMSNorm as RMSNormGated
from sglang.srt.distributed import split_tensor_along_last_dim, tensor_model_parallel_all_gather
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.attention.mamba.mamba import mamba_v2_sharded_weight_loader
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.radix_linear_attention import RadixLinearAttention
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.weight_utils import default_weight_loader, sharded_weight_loader
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils import add_prefix, make_layers, set_weight_attrs

from tailreplay_sglang.layout import FULL
from tailreplay_sglang.models.olmo_hybrid_gdn import beta_scale_of

# transformers' OlmoHybridRMSNormGated is built with eps=1e-5 whatever rms_norm_eps says (fla's default).
GATED_NORM_EPS = 1e-5


class OlmoHybridAttention(nn.Module):
    def __init__(self, config, layer_id: int, quant_config: Optional[QuantizationConfig], prefix: str):
        super().__init__()
        parallel = get_parallel()
        self.tp_size, self.tp_rank = parallel.tp_size, parallel.tp_rank
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.num_heads = total_heads // self.tp_size
        self.num_kv_heads = max(1, total_kv_heads // self.tp_size)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads,
                                          bias=config.attention_bias, quant_config=quant_config,
                                          prefix=add_prefix("qkv_proj", prefix))
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias=config.attention_bias,
                                        quant_config=quant_config, prefix=add_prefix("o_proj", prefix))
        # over all heads at once, as transformers' q_norm / k_norm
        self.q_norm = RMSNorm(total_heads * self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(total_kv_heads * self.head_dim, eps=config.rms_norm_eps)
        rope = config.rope_parameters
        self.rotary_emb = None
        if rope is not None and rope.get("rope_theta") is not None:
            # transformers rotates the whole head; only a non-default rope_type (yarn, ...) is passed on as scaling
            scaling = None if rope.get("rope_type", "default") == "default" else rope
            self.rotary_emb = get_rope(self.head_dim, rotary_dim=self.head_dim,
                                       max_position=config.max_position_embeddings, base=rope["rope_theta"],
                                       rope_scaling=scaling)
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
                                   layer_id=layer_id, quant_config=quant_config, prefix=add_prefix("attn", prefix))

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor):
        if self.tp_size > 1:  # the norms span all heads: gather, normalise, take this rank's heads back
            q, k = (tensor_model_parallel_all_gather(x.contiguous()) for x in (q, k))
        q, k = self.q_norm.forward_native(q), self.k_norm.forward_native(k)
        if self.tp_size > 1:
            split = partial(split_tensor_along_last_dim, num_partitions=self.tp_size)
            q, k = split(q)[self.tp_rank], split(k)[self.tp_rank]
        return q, k

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._qk_norm(q, k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v, forward_batch))
        return out


class OlmoHybridGatedDeltaNet(nn.Module):
    def __init__(self, config, layer_id: int, quant_config: Optional[QuantizationConfig], prefix: str):
        super().__init__()
        parallel = get_parallel()
        tp_size, tp_rank = parallel.attn_tp_size, parallel.attn_tp_rank
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        key_dim, value_dim = self.head_k_dim * self.num_k_heads, self.head_v_dim * self.num_v_heads
        self.local_v_heads = self.num_v_heads // tp_size
        self.beta_scale = beta_scale_of(config)
        linear = dict(bias=False, quant_config=quant_config, parallel_group="attn_tp")
        # q | k | v is the conv's channel order; each part is head-sharded on its own, as the conv weight below
        self.qkv_proj = MergedColumnParallelLinear(config.hidden_size, [key_dim, key_dim, value_dim],
                                                   prefix=add_prefix("qkv_proj", prefix), **linear)
        self.ab_proj = MergedColumnParallelLinear(config.hidden_size, [self.num_v_heads] * 2,
                                                  prefix=add_prefix("ab_proj", prefix), **linear)
        self.g_proj = ColumnParallelLinear(config.hidden_size, value_dim, prefix=add_prefix("g_proj", prefix),
                                           **linear)
        self.o_proj = RowParallelLinear(value_dim, config.hidden_size, input_is_parallel=True,
                                        prefix=add_prefix("o_proj", prefix), **linear)

        self.conv1d = ColumnParallelLinear(config.linear_conv_kernel_dim, 2 * key_dim + value_dim, bias=False,
                                           quant_config=None, parallel_group="attn_tp",
                                           prefix=add_prefix("conv1d", prefix))
        self.conv1d.weight.data = self.conv1d.weight.data.unsqueeze(1)  # [conv_dim, 1, width], HF's Conv1d layout
        delattr(self.conv1d.weight, "weight_loader")
        shards = [(key_dim, 0, False), (key_dim, 0, False), (value_dim, 0, False)]
        set_weight_attrs(self.conv1d.weight,
                         {"weight_loader": mamba_v2_sharded_weight_loader(shards, tp_size, tp_rank)})
        self.A_log = nn.Parameter(torch.zeros(self.local_v_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(self.local_v_heads))
        for param in (self.A_log, self.dt_bias):
            set_weight_attrs(param, {"weight_loader": sharded_weight_loader(0, parallel_group="attn_tp")})

        self.o_norm = RMSNormGated(self.head_v_dim, eps=GATED_NORM_EPS, group_size=None, norm_before_gate=True,
                                   activation="swish")
        self.attn = RadixLinearAttention(
            layer_id=layer_id, num_q_heads=self.num_k_heads // tp_size, num_k_heads=self.num_k_heads // tp_size,
            num_v_heads=self.local_v_heads, head_q_dim=self.head_k_dim, head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim, conv_weights=self.conv1d.weight.squeeze(1), bias=None,
            activation=config.hidden_act, A_log=self.A_log, dt_bias=self.dt_bias)

    def project(self, hidden_states: torch.Tensor):
        """Pre-conv q | k | v and the raw gate inputs a, b [T, HV] (also what a Tail-Replay replay needs)."""
        mixed_qkv, _ = self.qkv_proj(hidden_states)
        ab, _ = self.ab_proj(hidden_states)
        a, b = (x.contiguous() for x in ab.split([self.local_v_heads] * 2, dim=-1))
        return mixed_qkv, a, b

    def output(self, core: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Gated norm (gate = SiLU of the g projection) and output projection of the GDN core output."""
        gate, _ = self.g_proj(hidden_states)
        T = hidden_states.shape[0]
        out = self.o_norm(core.reshape(-1, self.head_v_dim), gate.reshape(-1, self.head_v_dim)).reshape(T, -1)
        out, _ = self.o_proj(out)
        return out

    def forward(self, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        mixed_qkv, a, b = self.project(hidden_states)
        core = self.attn(forward_batch, mixed_qkv=mixed_qkv, a=a, b=b)
        return self.output(core, hidden_states)


class OlmoHybridMLP(nn.Module):
    def __init__(self, config, quant_config: Optional[QuantizationConfig], prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False,
                                                       quant_config=quant_config,
                                                       prefix=add_prefix("gate_up_proj", prefix))
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False,
                                           quant_config=quant_config, prefix=add_prefix("down_proj", prefix))
        if config.hidden_act != "silu":
            raise ValueError(f"OLMo-Hybrid MLP: only silu is supported, got {config.hidden_act}")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(gate_up))
        return x


class OlmoHybridAttentionDecoderLayer(nn.Module):
    """Post-norm: the norms apply to the attention and MLP outputs, before each residual add."""

    def __init__(self, config, layer_id: int, quant_config, prefix: str):
        super().__init__()
        self.self_attn = OlmoHybridAttention(config, layer_id, quant_config, add_prefix("self_attn", prefix))
        self.mlp = OlmoHybridMLP(config, quant_config, add_prefix("mlp", prefix))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, forward_batch):
        hidden_states = hidden_states + self.post_attention_layernorm(
            self.self_attn(positions, hidden_states, forward_batch))
        return hidden_states + self.post_feedforward_layernorm(self.mlp(hidden_states))


class OlmoHybridLinearDecoderLayer(nn.Module):
    """Pre-norm: h += gdn(input_layernorm(h)); h += mlp(post_attention_layernorm(h))."""

    carries_stream_in_hidden_states = True  # Tail-Replay captures a group's input as this layer's input

    def __init__(self, config, layer_id: int, quant_config, prefix: str):
        super().__init__()
        self.linear_attn = OlmoHybridGatedDeltaNet(config, layer_id, quant_config, add_prefix("linear_attn", prefix))
        self.mlp = OlmoHybridMLP(config, quant_config, add_prefix("mlp", prefix))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, forward_batch):
        hidden_states = hidden_states + self.linear_attn(self.input_layernorm(hidden_states), forward_batch)
        return self.mlp_block(hidden_states)

    def mlp_block(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class OlmoHybridModel(nn.Module):
    def __init__(self, config, quant_config: Optional[QuantizationConfig] = None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=add_prefix("embed_tokens", prefix))

        def layer(idx: int, prefix: str):
            cls = OlmoHybridAttentionDecoderLayer if config.layer_types[idx] == FULL else OlmoHybridLinearDecoderLayer
            return cls(config, idx, quant_config, prefix)

        self.layers = make_layers(config.num_hidden_layers, layer, prefix=add_prefix("layers", prefix))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, forward_batch: ForwardBatch, input_embeds=None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, forward_batch)
        return self.norm(hidden_states)


# OLMo-Hybrid checkpoints keep OLMo-core's names, which transformers renames on load (its conversion_mapping.py):
# two norms, and the conv split into q / k / v parts that it concatenates.
_RENAMES = (("attention_layer_norm", "input_layernorm"), ("feedforward_layer_norm", "post_attention_layernorm"))
_CONV_PARTS = {"q_conv1d": 0, "k_conv1d": 1, "v_conv1d": 2}

# checkpoint name -> (our parameter, shard id), per module kind; matched on whole name segments
_STACKED = {
    "self_attn": {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")},
    "linear_attn": {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                    "a_proj": ("ab_proj", 0), "b_proj": ("ab_proj", 1),
                    **{part: ("conv1d", shard) for part, shard in _CONV_PARTS.items()}},
    "mlp": {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)},
}


def _stacked_target(name: str):
    """'model.layers.3.linear_attn.a_proj.weight' -> ('model.layers.3.linear_attn.ab_proj.weight', 0), or None."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        mapping = _STACKED.get(parts[i], {})
        if parts[i + 1] in mapping:
            param, shard = mapping[parts[i + 1]]
            return ".".join(parts[: i + 1] + [param] + parts[i + 2:]), shard
    return None


class OlmoHybridForCausalLM(nn.Module):
    def __init__(self, config, quant_config: Optional[QuantizationConfig] = None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.model = OlmoHybridModel(config, quant_config, prefix=add_prefix("model", prefix))
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                          prefix=add_prefix("lm_head", prefix))
        self.logits_processor = LogitsProcessor(config)

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch: ForwardBatch, input_embeds=None, **kwargs):
        hidden_states = self.model(input_ids, positions, forward_batch, input_embeds)
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded, conv_parts = set(), {}
        for name, tensor in weights:
            if name.startswith("mtp.") or "rotary_emb.inv_freq" in name or (self.config.tie_word_embeddings and name.startswith("lm_head.")):
                continue
            for old, new in _RENAMES:
                name = name.replace(old, new)
            target = _stacked_target(name)
            if target is not None:
                param_name, shard = target
                param = params[param_name]
                if param_name.endswith("conv1d.weight"):
                    self._load_conv_part(param, tensor, shard, conv_parts.setdefault(param_name, {}))
                else:
                    param.weight_loader(param, tensor, shard)
            else:
                param_name = name
                param = params[param_name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(param_name)
        return loaded

    @staticmethod
    def _load_conv_part(param: torch.Tensor, part: torch.Tensor, index: int, parts: dict) -> None:
        """Keep q_conv1d / k_conv1d / v_conv1d until all three came, then load their concatenation as transformers
        does. Only the concatenation is meaningful: transformers' save_pretrained splits it back into three equal
        chunks, not into key / key / value sizes."""
        parts[index] = part
        if len(parts) == len(_CONV_PARTS):
            param.weight_loader(param, torch.cat([parts[i] for i in range(len(_CONV_PARTS))], dim=0))


EntryClass = [OlmoHybridForCausalLM]
