"""HF transformers reference for the models this project serves, runnable on CPU.

transformers prefers fla's Triton kernels for GDN layers whenever fla is importable, and Triton has no CPU driver,
so on CPU we point the modeling module back at its own pure-torch functions.
"""

import importlib
import json
import tempfile
from pathlib import Path

import torch
from torch import nn

from tailreplay_eval import jet_nemotron, kimi_k3, kimi_k3_vl, ling, ling25, nemotron_puzzle, zaya

# names of the recurrent functions a modeling module defines, which transformers routes to fla when it is installed
_GDN = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")
_KDA = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn", "causal_conv1d_update")
# modeling module -> those names
_GDN_FUNCTIONS = {
    "transformers.models.qwen3_5.modeling_qwen3_5": _GDN,
    "transformers.models.qwen3_next.modeling_qwen3_next": _GDN,
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": _GDN,
    "transformers.models.qwen4_exp.modeling_qwen4_exp": _GDN,
    "transformers.models.olmo_hybrid.modeling_olmo_hybrid": _GDN,
    "transformers.models.kimi_linear.modeling_kimi_linear": _KDA,
    "transformers.models.glm5_next.modeling_glm5_next": _KDA,
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
    is_vl = (any(a.endswith("ForConditionalGeneration") for a in (config.architectures or []))
             or getattr(config, "vision_config", None) is not None)  # NemotronH_Omni_Reasoning_V3
    loader = AutoModelForImageTextToText if is_vl else AutoModelForCausalLM
    return loader.from_pretrained(model_path, dtype=dtype).eval()


def load_reference(model_path, dtype=torch.float32):
    """What a served checkpoint is checked against: transformers' model where transformers has the architecture,
    else a torch reference (Ling-3.0: `load_ling_reference`; Ling-2.5: `load_ling25_reference`; Nemotron-H Puzzle:
    transformers' Nemotron-H with per-layer blocks, `nemotron_puzzle.load_reference`; Jet-Nemotron: transformers'
    Qwen2 with torch JetBlocks, `jet_nemotron.load_reference`; Kimi K3: transformers' Kimi Linear under attention
    residuals, `load_kimi_k3_reference`, and K3's vision checkpoint's language model)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    if config.get("architectures") == [jet_nemotron.ARCHITECTURE]:
        return jet_nemotron.load_reference(Path(model_path), dtype)
    if config.get("architectures") == [ling25.ARCHITECTURE]:
        return load_ling25_reference(Path(model_path), dtype)
    if config.get("model_type") == "bailing_hybrid":
        return load_ling_reference(Path(model_path), dtype)
    if config.get("architectures") == [kimi_k3.K3_ARCHITECTURE]:
        return load_kimi_k3_reference(Path(model_path), dtype)
    if config.get("architectures") == [kimi_k3_vl.ARCHITECTURE]:  # its language model, on text
        with tempfile.TemporaryDirectory(prefix="k3-text-") as folder:
            return load_kimi_k3_reference(kimi_k3_vl.write_language_model(Path(model_path), Path(folder)), dtype)
    if config.get("architectures") == [zaya.ARCHITECTURE]:  # Zyphra's layout, renamed back for transformers
        return zaya.load_reference(Path(model_path), dtype)
    if config.get("architectures") == [nemotron_puzzle.ARCHITECTURE]:
        force_torch_gdn()
        return nemotron_puzzle.load_reference(Path(model_path), dtype)
    return load_hf_model(model_path, dtype)


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
def prompt_logprobs(model, input_ids: list[int], use_cache: bool | None = None) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1. `use_cache=False` where the model fails under its own cache
    (transformers 5.19's Qwen4-Exp PLE layer: `has_previous_state(layer, state_idx=2)`, KeyError)."""
    ids = torch.tensor([input_ids])
    logits = model(input_ids=ids, **({} if use_cache is None else {"use_cache": use_cache})).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0].tolist()


@torch.no_grad()
def layer_states(model, input_ids: list[int]) -> dict[str, dict[int, torch.Tensor]]:
    """Each linear-attention layer's state after the prompt, in SGLang's pool layout and float32, as the test
    plugin's probe dumps a replay's (`{"temporal": {layer: [HV, V, K]}, "conv": {layer: [dim, width - 1]}}`): HF's GDN
    recurrent state ([1, HV, K, V]) transposed, and the last width - 1 columns of the conv window HF keeps
    ([1, dim, width]), where width is the model's conv kernel."""
    cache = model(input_ids=torch.tensor([input_ids]), use_cache=True).past_key_values

    def held(layer, name):  # a cache layer's first sequence's state, or None where the layer keeps none
        states = getattr(layer, name, None)
        return None if not states or states[0] is None else states[0][0]
    temporal = {i: held(layer, "recurrent_states").transpose(-1, -2).float() for i, layer in enumerate(cache.layers)
                if held(layer, "recurrent_states") is not None}
    conv = {i: held(layer, "conv_states")[:, 1:].float() for i, layer in enumerate(cache.layers)
            if held(layer, "conv_states") is not None}
    return {"temporal": temporal, "conv": conv}


# --- Ling-3.0: transformers' Kimi Linear with Ling's MLA (tailreplay_eval.ling explains the differences) ---

def _rotate_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE on pairs (0, 1), (2, 3), ... of the last dim (GPT-J style, Bailing's `rope_interleave`); x [..., T, d]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class GatedRopeMLA(nn.Module):
    """Ling-3.0's MLA layer in plain torch: transformers' Kimi MLA projections (copied from `mla`), rope on the
    query's and the shared key's rope parts at their positions, and the output gate. The rotated key latent is what
    the cache keeps, so cached decoding sees each key at its own position."""

    def __init__(self, mla: nn.Module, gate: torch.Tensor | None, theta: float) -> None:
        super().__init__()
        self.mla, self.theta = mla, theta
        # each off: Kimi's MLA in that respect (tests show the reference needs both); no gate: Ling-2.5's MLA
        self.gated, self.rotated = gate is not None, True
        if gate is not None:
            self.g_proj = nn.Linear(gate.shape[1], gate.shape[0], bias=False, dtype=gate.dtype)
            self.g_proj.weight.copy_(gate)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        mla = self.mla
        batch, length = hidden_states.shape[:-1]
        past = past_key_values.get_seq_length(mla.layer_idx) if past_key_values is not None else 0
        positions = torch.arange(past, past + length) if self.rotated else torch.zeros(length, dtype=torch.long)
        q = mla.q_proj(hidden_states).view(batch, length, -1, mla.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        q = torch.cat((q_nope, _rotate_interleaved(q_rot, positions, self.theta)), dim=-1)
        kv_nope, k_rot = mla.kv_a_proj_with_mqa(hidden_states).split([mla.kv_lora_rank, mla.qk_rope_head_dim], -1)
        kv_nope = mla.kv_a_layernorm(kv_nope).view(batch, 1, length, mla.kv_lora_rank)
        k_rot = _rotate_interleaved(k_rot.view(batch, 1, length, mla.qk_rope_head_dim), positions, self.theta)
        if past_key_values is not None:
            kv_nope, k_rot = past_key_values.update(kv_nope, k_rot, mla.layer_idx)
        k, v = mla.expand_kv(kv_nope, k_rot)
        scores = (q @ k.transpose(-1, -2)).float() * mla.scaling
        total = k.shape[-2]
        causal = torch.arange(total)[None, :] > (total - length + torch.arange(length))[:, None]
        weights = scores.masked_fill(causal, float("-inf")).softmax(-1).to(v.dtype)
        out = (weights @ v).transpose(1, 2).reshape(batch, length, -1)
        return mla.o_proj(out * torch.sigmoid(self.g_proj(hidden_states)) if self.gated else out), None


@torch.no_grad()
def load_ling_reference(checkpoint: Path, dtype=torch.float32):
    """A Ling-3.0 checkpoint (`tailreplay_eval.ling`) as transformers' Kimi Linear (`ling.write_as_kimi`, loaded by
    transformers) with `GatedRopeMLA` in each MLA layer and BailingKDA's norm eps; in eval mode, on the torch KDA
    path."""
    with tempfile.TemporaryDirectory(prefix="ling-as-kimi-") as folder:
        gates = ling.write_as_kimi(checkpoint, Path(folder))
        model = load_hf_model(folder, dtype)
    theta = json.loads((checkpoint / "config.json").read_text())["rope_parameters"]["rope_theta"]
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "o_norm"):  # a third difference: BailingKDA fixes its gated norm's eps
            layer.self_attn.o_norm.variance_epsilon = ling.KDA_NORM_EPS
    for name, gate in gates.items():
        layer = model.model.layers[int(name.split(".")[2])]
        layer.self_attn = GatedRopeMLA(layer.self_attn, gate.to(dtype), theta)
    return model.eval()


# --- Ling-2.5: transformers' Kimi Linear with lightning attention (tailreplay_eval.ling25 explains the differences) ---

def _rotate_halves(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE on the pairs (i, i + d/2) of the last dim (NeoX style, Bailing's lightning q and k); x [T, heads, d]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    first, second = x[..., :d // 2], x[..., d // 2:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class LightningAttention(nn.Module):
    """Ling-2.5's lightning-attention mixer in plain torch (float64 inside): per-head q/k RMSNorm, NeoX RoPE at the
    tokens' positions, `S_t = exp(-slope) S_{t-1} + k_t^T v_t`, `o_t = q_t S_t / sqrt(d)` token by token, groupwise
    RMSNorm times sigmoid of the gate, output projection. Keeps its own state and position across the calls of one
    transformers cache (a new cache object starts from zero)."""

    def __init__(self, weights: dict[str, torch.Tensor], config: dict, layer: int) -> None:
        super().__init__()
        self.weights = {name: w.double() for name, w in weights.items()}
        self.heads, self.head_dim = config["num_attention_heads"], config["head_dim"]
        self.eps, self.theta = config["rms_norm_eps"], config["rope_theta"]
        self.group = self.heads * self.head_dim // config["group_norm_size"]
        self.slope = ling25.slopes(config, layer)
        # each off: a simpler mixer (tests show the reference needs each): no RoPE, no q/k norm, one norm group
        self.rotated = self.qk_normed = self.grouped = True
        self._cache, self._state, self._seen = object(), None, 0

    def forward(self, hidden_states, cache_params=None, **kwargs):
        if cache_params is None or cache_params is not self._cache:
            self._cache, self._seen = cache_params, 0
            self._state = torch.zeros(self.heads, self.head_dim, self.head_dim, dtype=torch.float64)
        w, x = self.weights, hidden_states[0].double()
        length = x.shape[0]
        q, k, v = (x @ w["query_key_value.weight"].T).view(length, 3, self.heads, self.head_dim).unbind(1)
        positions = torch.arange(self._seen, self._seen + length)
        if self.qk_normed:
            q, k = _rms(q, w["query_layernorm.weight"], self.eps), _rms(k, w["key_layernorm.weight"], self.eps)
        if self.rotated:
            q, k = _rotate_halves(q, positions, self.theta), _rotate_halves(k, positions, self.theta)
        decay, outs = torch.exp(-self.slope)[:, None, None], []
        for t in range(length):
            self._state = decay * self._state + k[t][:, :, None] * v[t][:, None, :]
            outs.append(torch.einsum("hd,hdv->hv", q[t], self._state) * self.head_dim ** -0.5)
        self._seen += length
        group = self.group if self.grouped else self.heads * self.head_dim
        o = torch.stack(outs).reshape(length, -1, group)
        o = _rms(o, w["g_norm.weight"].view(-1, group), self.eps).reshape(length, -1)
        o = o * torch.sigmoid(x @ w["g_proj.weight"].T)
        return (o @ w["dense.weight"].T).to(hidden_states.dtype)[None]


@torch.no_grad()
def load_ling25_reference(checkpoint: Path, dtype=torch.float32):
    """A Ling-2.5 checkpoint (`tailreplay_eval.ling25`) as transformers' Kimi Linear over its shared weights, with
    `LightningAttention` in each linear layer and an ungated `GatedRopeMLA` in each MLA layer; in eval mode."""
    config = json.loads((checkpoint / "config.json").read_text())
    with tempfile.TemporaryDirectory(prefix="ling25-as-kimi-") as folder:
        ling25.write_as_kimi(checkpoint, Path(folder))
        model = load_hf_model(folder, dtype)
    mixers = ling25.lightning_weights(checkpoint)
    for index, layer in enumerate(model.model.layers):
        if index in mixers:
            layer.self_attn = LightningAttention(mixers[index], config, index)
        else:
            layer.self_attn = GatedRopeMLA(layer.self_attn, None, config["rope_theta"])
    return model.eval()


# --- Kimi K3: transformers' Kimi Linear under attention residuals (tailreplay_eval.kimi_k3 explains the rest) ---

class ResidualScorer(nn.Module):
    """One read of the attention-residual bank: each row's score is `proj(rms_norm(row))`; the read is the rows'
    softmax mixture over depth, per token (SGLang's `aggregate_stream_torch`, written here from the description)."""

    def __init__(self, norm: torch.Tensor, proj: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.norm, self.proj, self.eps = nn.Parameter(norm), nn.Parameter(proj), eps

    def forward(self, rows: list[torch.Tensor]) -> torch.Tensor:
        stacked = torch.stack(rows, dim=-2)  # [..., R, hidden]
        scores = _rms(stacked, self.norm, self.eps) @ self.proj.T  # [..., R, 1]
        weights = scores.float().softmax(dim=-2)
        return (weights * stacked.float()).sum(dim=-2).to(stacked.dtype)


class AttnResidualKimi(nn.Module):
    """Kimi K3's layer stack over transformers' Kimi Linear layers: every attention and feed-forward input is the
    mixture of the bank and the running residual, normed by the layer's own norm; layer l % B == 0 banks its running
    residual and restarts it; the output is the output scorer's mixture, then the final norm."""

    def __init__(self, model: nn.Module, extra: dict[str, torch.Tensor], block_size: int, eps: float) -> None:
        super().__init__()
        self.model, self.block_size = model, block_size
        self.mixing = True  # off: Kimi Linear's plain residual stream (what the tests show the reference needs)

        def scorer(prefix):
            return ResidualScorer(extra[f"{prefix}norm.weight"], extra[f"{prefix}proj.weight"], eps)
        self.attn_reads = nn.ModuleList(scorer(f"model.layers.{i}.self_attention_res_")
                                        for i in range(len(model.layers)))
        self.ffn_reads = nn.ModuleList(scorer(f"model.layers.{i}.mlp_res_") for i in range(len(model.layers)))
        self.output_read = scorer("model.output_attn_res_")

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False):
        config, bank, running, pending = self.model.config, [], None, hidden_states
        for i, layer in enumerate(self.model.layers):
            prefix = pending if running is None else running + pending
            h = layer.input_layernorm(self.attn_reads[i](bank + [prefix]))
            if i % self.block_size == 0 and self.mixing:
                bank, running = bank + [prefix], None
            else:
                running = prefix
            if config.layer_types[i] == "linear_attention":
                out = layer.self_attn(hidden_states=h, cache_params=past_key_values, attention_mask=None)
            else:
                out, _ = layer.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                                         past_key_values=past_key_values, use_cache=use_cache)
            running = out if running is None else running + out
            pending = layer.mlp(layer.post_attention_layernorm(self.ffn_reads[i](bank + [running])))
        return self.model.norm(self.output_read(bank + [running + pending]))


@torch.no_grad()
def load_kimi_k3_reference(checkpoint: Path, dtype=torch.float32):
    """A Kimi K3 checkpoint (`tailreplay_eval.kimi_k3`) as transformers' Kimi Linear over its shared weights, with
    the layer stack run by `AttnResidualKimi` and a gated NoPE `GatedRopeMLA` in each MLA layer; in eval mode."""
    with tempfile.TemporaryDirectory(prefix="k3-as-kimi-") as folder:
        config, extra = kimi_k3.write_as_kimi(checkpoint, Path(folder))
        model = load_hf_model(folder, dtype)
    extra = {name: t.to(dtype) for name, t in extra.items()}
    for index, layer in enumerate(model.model.layers):
        gate = extra.get(f"model.layers.{index}.self_attn.g_proj.weight")
        if gate is not None:
            layer.self_attn = GatedRopeMLA(layer.self_attn, gate, theta=1.0)
            layer.self_attn.rotated = False  # K3's MLA is NoPE, as Kimi Linear's
    stack = AttnResidualKimi(model.model, extra, config["attn_res_block_size"], config["rms_norm_eps"])
    model.model.forward = _k3_model_forward(model.model, stack)
    model.k3_stack = stack
    return model.eval()


def _k3_model_forward(body: nn.Module, stack: AttnResidualKimi):
    """transformers' Kimi Linear model forward (embedding, cache, masks) around `stack` instead of its own loop."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_outputs import MoeModelOutputWithPast

    def forward(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, **kwargs):
        embeds = body.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=body.config)
        seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(seen, seen + embeds.shape[1]).unsqueeze(0)
        mask = create_causal_mask(config=body.config, inputs_embeds=embeds, attention_mask=attention_mask,
                                  past_key_values=past_key_values, position_ids=position_ids)
        hidden = stack(embeds, mask, position_ids, past_key_values, use_cache)
        return MoeModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values)
    return forward
