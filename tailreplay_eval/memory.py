"""What each prefix cache keeps in memory, from a model's config and the server's flags.

bench/memory.py prints this accounting; bench/ttft.py and bench/workloads.py print its table and put it in their
JSON, so that reuse is weighed against what it costs (bench/load.py and bench/pareto.py use it too):
- FA KV per cached token (stock and Tail-Replay alike);
- Tail-Replay's stored hiddens per cached token (`hidden_store.bytes_per_token` at the server's hidden dtype:
  `--tail-replay-hidden-dtype auto`, the default, is the serving dtype, resolved as SGLang resolves `--dtype`);
- one mamba slot: the conv + SSM states of every GDN layer. Stock SGLang holds one per running request (three with
  `extra_buffer`: two ping-pong track slots) and one per cached checkpoint (where a request or a prefill chunk
  ends). Tail-Replay holds one per running request and, with anchored replay on (`--tail-replay-exact-budget` not
  0), one per anchor: the same request-end and chunk-end states stock keeps, plus one every
  `--tail-replay-anchor-interval N` tokens of a prefill. One anchor is exactly one mamba slot, so interval anchors
  cost slot / N bytes per cached token. In paper mode (`--tail-replay-exact-budget 0`) it holds no slot per cached
  prefix at all.

Per cached token the table compares: stock (FA KV only, plus one slot per checkpoint), paper mode (KV + hiddens)
and anchored replay at each interval N (KV + hiddens + slot / N). Anchors live in the mamba pool and SGLang's
mamba LRU evicts them (the node keeps its KV and hits through the zero-init tail), so slot / N is the cost while
every interval anchor is kept. Interval anchors come from the chunked prefill's per-chunk states on every device.
Host anchors (`--tail-replay-host-anchors`) live in host memory and are not counted here.

The formulas are SGLang 0.5.23's own pool sizing, restated so that no server or parallel state is needed:
`configs/mamba_utils.py` (`Mamba2StateShape.create`, `BaseLinearStateParams.mamba_cache_per_req`, conv dtype from
`SGLANG_MAMBA_CONV_DTYPE`, default bfloat16; SSM dtype float32 unless the config or `SGLANG_MAMBA_SSM_DTYPE` says
otherwise), the serving dtype of `configs/model_config._get_and_verify_dtype` (`--dtype auto`: the checkpoint's
dtype, float16 for a float32 checkpoint), the KV dtype of `mem_cache/kv_cache_dtype.configure_kv_cache_dtype`
(`--kv-cache-dtype auto`: the serving dtype) and the per-token KV cell of `DefaultPoolConfigurator._compute_cell_size`
(K and V of every FA layer; MLA's latent for Kimi Linear). All at TP 1, except `account_per_rank`
(`bench/memory.py --per-rank`): one attention-TP rank's KV heads, states and hidden-store part. The server log shows
the same numbers: `Tail-Replay: KV cell ... B/token + hidden store ... B/token` and `Mamba Cache is allocated ...
ssm_state size`.

Qwen3.5-4B, Qwen3.6-27B, Nemotron-H-8B and Granite-4.0-H-Small are not read from the hub: their shapes are written
by hand below (`HAND_WRITTEN`), as we know them from the published configs. A Mamba2 model's (Nemotron-H,
Granite-4.0-H) slot is SGLang's `Mamba2StateShape`: conv over x | B | C (heads x head_dim + 2 x groups x state), SSM
heads x head_dim x state.

Refused models (Falcon-H1 and the 2026 frontier hybrids in `FRONTIER` that Tail-Replay refuses) get a row too: what
the store WOULD cost, with the refusal's reason (`architectures.REFUSED`). For those the store would have to keep
more than one hidden per group: every stream of a hyper-connection residual (`residual_streams`). Kimi K3's
attention-residual bank rows cost no store where every banking layer is a KDA layer (`attn_res_bank_rows`). Their
attention layers' indexer caches (`indexer_bytes_per_token`) are part of SGLang's KV cell, so stock's per-token cost
is KV + indexer.
"""

import argparse
import contextlib
import json
import os
import shlex
import tempfile
from pathlib import Path

import torch
from rich.table import Table

from tailreplay_sglang.architectures import REFUSED
from tailreplay_sglang.store import hidden_store
from tailreplay_sglang.config import TailReplayConfig
from tailreplay_sglang.layout import (BLOCK_KINDS, FULL, LINEAR, ConfigAttrs, HybridLayout, banking_attention_layers,
                                      is_parallel_hybrid, layer_kinds, text_config_of)
from tailreplay_sglang.plugin import add_cli_args, config_from_args

ROOT = Path(__file__).resolve().parents[1]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float": torch.float32,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}

ANCHOR_INTERVALS = (256, 512, 1024, 2048)  # the intervals tabulated unless the flags name one
CHUNK_TOKENS = 4096  # prefill chunk of the prefix-cost example (stock no_buffer keeps one state per chunk)

# The 2026 frontier hybrids SGLang 0.5.23 ships, at their published default shapes, in SGLang's field names (paths
# under .venv/.../sglang/srt). Tail-Replay refuses all five (architectures.REFUSED): their rows say what the store
# would cost. Where SGLang's config defaults are not the published model, the values come from
# ../shared/notes/frontier-hybrids-2026-12-06.md and field-2026-12-06.md section 6 ("notes"); "assumed" marks what
# neither gives. Text-only prompts: group 0's input (the embeddings) is not stored.
FRONTIER = {
    # configs/qwen4_exp.py: Qwen4ExpTextConfig(Qwen3NextConfig) keeps Qwen3-Next's defaults (configs/qwen3_next.py:
    # 186-208: hidden 2048, 48 layers, 2 KV heads x 256, GDN 16 key / 32 value heads x 128, conv 4), which are the
    # published 48 = 36 GDN + 12 QSA layers (notes; transformers 5.19's default is 40 layers). full_attention_interval
    # is read from the checkpoint (transformers' default 4). hc_count 4 streams (qwen4_exp.py:24). Every QSA field
    # defaults to None (QSA off) in both configs; assumed: index head 128, compress ratio 4 (the backend's fallback,
    # layers/attention/qwen_sparse_attn_backend.py:241), budget 2048 (2048 / 4 = 512 blocks, which
    # qsa/config.py:64 allows), 16 index query heads (these two do not enter the cache). No PLE layers (the default).
    "Qwen3.8-Flash-Next": {
        "model_type": "qwen4_exp_text", "architectures": ["Qwen4ExpForConditionalGeneration"],
        "hidden_size": 2048, "num_hidden_layers": 48, "full_attention_interval": 4,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "hc_count": 4,
        "indexer_n_heads": 16, "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048,
        "indexer_compress_ratio": 4, "dtype": "bfloat16",
    },
    # configs/glm5_next.py: hidden 4096, 45 layers, KDA on every layer but i % 4 == 3 (:85-89, :198-205), NoPE MLA
    # latent 512 + 0 (:118-120), KDA 64 heads x 128, conv 4 (:129-131). Its defaults mhc=False (:123) and index_* None
    # (:134-136: no DSA) are not the published model (mHC hc_mult 4 and a DSA indexer, notes; models/glm5_next.py:146
    # names "GLM-5.3-Flash's hc_mult=4"): mhc on, index_topk 2048, index_head_dim 128, 32 index heads (transformers
    # 5.19's defaults), index_kpool 4 (notes; transformers' default is 16, SGLang's when absent 1).
    "GLM-5.3-Flash": {
        "model_type": "glm5_next_text", "architectures": ["Glm5NextForConditionalGeneration"],
        "hidden_size": 4096, "num_hidden_layers": 45,
        "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(45)],
        "num_attention_heads": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 0,
        "linear_num_heads": 64, "linear_head_dim": 128, "linear_conv_kernel_dim": 4, "mhc": True, "hc_mult": 4,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "index_kpool": 4, "dtype": "bfloat16",
    },
    # configs/kimi_k3.py takes KimiLinearConfig, whose defaults (configs/kimi_linear.py: 32 layers, no KDA, no MLA,
    # attn_res_block_size None) are no model. Notes: 93 layers = 69 KDA + 24 gated NoPE MLA (every 4th; assumed: and
    # the last, as Kimi Linear). SGLang's K3 kernels fix hidden 7168 (kernels/ops/attention/attn_res.py:19) and KDA
    # 12 heads x 128 per rank at TP8 = 96 heads, conv 4 (kda_fused_decode.py:13-15); at most 8 bank rows are read
    # (attn_res.py:20), so attn_res_block_size >= 12 for 93 layers: assumed 12. Assumed: MLA latent 512 + 64 (Kimi
    # Linear's and K2's; SGLang's MLA pool keeps the rope part of a NoPE MLA too).
    "Kimi-K3": {
        "model_type": "kimi_linear", "architectures": ["KimiK3LinearForCausalLM"],
        "hidden_size": 7168, "num_hidden_layers": 93, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "linear_attn_config": {"full_attn_layers": [*range(4, 93, 4), 93],
                               "kda_layers": [i for i in range(1, 94) if i % 4 and i != 93],
                               "head_dim": 128, "num_heads": 96, "short_conv_kernel_size": 4},
        "attn_res_block_size": 12, "dtype": "bfloat16",
    },
    # configs/bailing_hybrid.py's defaults (hidden 2048, 20 layers, layer_group_size 1 = no linear layer) are a test
    # size. Notes: Ling-3.0-flash 42 = 35 KDA + 7 gated MLA (layer_group_size 6, :178-183), KDA from use_kda
    # (short_conv_kernel_size set, :158; assumed 4). MLA latent 512 + 64 (:93, :95; use_mla_nope off). Assumed:
    # hidden 4096, 32 heads x 128 (Ling-flash-2.0's); KDA runs over the attention heads (:216-222).
    "Ling-3.0-flash": {
        "model_type": "bailing_hybrid", "architectures": ["BailingMoeV3ForCausalLM"],
        "hidden_size": 4096, "num_hidden_layers": 42, "layer_group_size": 6, "num_attention_heads": 32,
        "head_dim": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "short_conv_kernel_size": 4,
        "dtype": "bfloat16",
    },
    # Notes: Ling-2.5-1T 80 = 70 lightning + 10 MLA (layer_group_size 8); lightning state [heads, head_dim,
    # head_dim], no conv (bailing_hybrid.py:226-236). Assumed: hidden 8192, 64 heads x 128 (Ling-1T's, the backbone
    # Ling-2.5 was retrofitted from).
    "Ling-2.5-1T": {
        "model_type": "bailing_hybrid", "architectures": ["BailingMoeV2_5ForCausalLM"],
        "hidden_size": 8192, "num_hidden_layers": 80, "layer_group_size": 8, "num_attention_heads": 64,
        "head_dim": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "dtype": "bfloat16",
    },
}

# The real models' shapes as we know them from their published config.json (text part), written by hand: there is
# no hub access here. A checkpoint's own config.json (`--model-path`) always wins over these.
HAND_WRITTEN_NOTE = ("Qwen3.5-4B, Qwen3.6-27B, Nemotron-H-8B, Granite-4.0-H-Small, Falcon-H1-7B, "
                     "Kimi-Linear-48B-A3B and the frontier hybrids (Qwen3.8-Flash-Next, GLM-5.3-Flash, Kimi-K3, "
                     "Ling-3.0-flash, Ling-2.5-1T; where SGLang's defaults are not the published model, the notes' "
                     "figures, some assumed: FRONTIER's comments): shapes written by hand from the published "
                     "configs as we know them, not read from a checkpoint")
HAND_WRITTEN = {
    "Qwen3.5-4B": {
        "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
        "hidden_size": 2560, "num_hidden_layers": 32, "full_attention_interval": 4,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "dtype": "bfloat16",
    },
    "Qwen3.6-27B": {
        "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
        "hidden_size": 5120, "num_hidden_layers": 64, "full_attention_interval": 4,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "dtype": "bfloat16",
    },
    # SGLang's NemotronHConfig defaults are Nemotron-H-8B's (52 layers, 4 attention).
    "Nemotron-H-8B": {
        "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "hidden_size": 4096,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128,
        "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "dtype": "bfloat16",
    },
    # 40 layers, one attention layer in ten (positions as we recall them; only their count enters the figures).
    "Granite-4.0-H-Small": {
        "model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"], "hidden_size": 4096,
        "layer_types": ["attention" if i % 10 == 5 else "mamba" for i in range(40)],
        "num_attention_heads": 32, "num_key_value_heads": 8, "mamba_n_heads": 128, "mamba_d_head": 64,
        "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "dtype": "bfloat16",
    },
    # 27 layers: MLA at 4, 8, ..., 24 and 27 (1-indexed), KDA elsewhere; NoPE MLA with a 512 + 64 latent.
    "Kimi-Linear-48B-A3B": {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "hidden_size": 2304,
        "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                               "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                               "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
        "dtype": "bfloat16",
    },
    # Attention and Mamba2 side by side in all 44 layers (transformers' Falcon-H1 model doc gives the same sizes).
    # Tail-Replay refuses it: the row says what the store would cost.
    "Falcon-H1-7B": {
        "model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"], "hidden_size": 3072,
        "num_hidden_layers": 44, "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128,
        "mamba_n_heads": 24, "mamba_d_head": 128, "mamba_d_ssm": 3072, "mamba_n_groups": 1, "mamba_d_state": 256,
        "mamba_d_conv": 4, "mamba_chunk_size": 128, "dtype": "bfloat16",
    },
    **FRONTIER,
}
ALL_MODELS = ("small", "quality-qwen35", "Qwen3.5-4B", "Qwen3.6-27B", "Nemotron-H-8B", "Granite-4.0-H-Small",
              "Kimi-Linear-48B-A3B", "Falcon-H1-7B", *FRONTIER)
# --all without --server-args: each model served as it is here (the presets in float32 on the CPU) or in practice
# (the real models in their checkpoint dtype).
ALL_DEFAULT_ARGS = {"small": "--dtype float32", "quality-qwen35": "--dtype float32",
                    "Qwen3.5-4B": "--dtype auto", "Qwen3.6-27B": "--dtype auto", "Nemotron-H-8B": "--dtype auto",
                    "Granite-4.0-H-Small": "--dtype auto", "Kimi-Linear-48B-A3B": "--dtype auto",
                    "Falcon-H1-7B": "--dtype auto", **{name: "--dtype auto" for name in FRONTIER}}


def _flag(flags: list[str], name: str, default: str | None = None) -> str | None:
    """Value of `--name X` or `--name=X` in a server flag list (the last one wins, as in argparse)."""
    value = default
    for i, arg in enumerate(flags):
        if arg == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _with_layer_types(config: dict) -> dict:
    """The config with `layer_types` spelled out in the layout's kinds (from `full_attention_interval`, as SGLang's
    Qwen3-Next config derives its layer pattern, or Bailing's `layer_group_size`, the same rule; from Nemotron-H's
    pattern; Granite's mamba / attention; Kimi Linear's linear_attn_config). A parallel hybrid has no pattern to
    spell out."""
    if is_parallel_hybrid(config.get("architectures") or ()):
        return config
    if any(config.get(key) for key in ("layer_types", "hybrid_override_pattern", "layers_block_type",
                                       "linear_attn_config")):
        return {**config, "layer_types": list(layer_kinds(ConfigAttrs(config)))}
    interval = config.get("full_attention_interval") or config.get("layer_group_size")
    n = config["num_hidden_layers"]
    types = [FULL if interval and (i + 1) % interval == 0 else LINEAR for i in range(n)]
    return {**config, "layer_types": types}


def _text_config(model_path: Path) -> dict:
    """The text part of a checkpoint's config.json. A vision-language checkpoint keeps its dtype (and maybe
    `mamba_ssm_dtype`) at the top level, which SGLang reads there: those come along."""
    raw = json.loads((Path(model_path) / "config.json").read_text())
    text = dict(text_config_of(raw))
    for key in ("architectures", "dtype", "torch_dtype", "mamba_ssm_dtype"):
        if key not in text and key in raw:
            text[key] = raw[key]
    return text


def _preset_architecture(preset) -> str:
    """The architecture transformers writes into the preset's config.json when `models.build_model` saves it."""
    from transformers.models.auto import modeling_auto

    names = (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if preset.vision
             else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return names[preset.model_type]


def preset_config(preset: str) -> dict:
    """A preset's config from its spec in `tailreplay_eval/models.py`, without building it."""
    from tailreplay_eval import models  # transformers: imported only when a preset is not built

    p = models.PRESETS[preset]
    return {
        "architectures": [_preset_architecture(p)], "model_type": p.model_type, "hidden_size": p.hidden_size,
        "num_hidden_layers": p.num_hidden_layers,
        "layer_types": models.layer_types(p.num_hidden_layers),
        "full_attention_interval": models.FULL_ATTENTION_INTERVAL,
        "num_attention_heads": p.num_attention_heads, "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim, "linear_num_key_heads": p.linear_num_key_heads,
        "linear_num_value_heads": p.linear_num_value_heads, "linear_key_head_dim": p.linear_head_dim,
        "linear_value_head_dim": p.linear_head_dim,
        "linear_conv_kernel_dim": 4,  # as `models.model_config` writes it
        "dtype": p.dtype,
    }


def resolve_model(model) -> tuple[str, dict, str]:
    """(name, text config, where the config came from) for a checkpoint directory, a preset name (its build under
    models/ if there is one, else its spec), a hand-written model name, or a config dict."""
    if isinstance(model, dict):
        return model.get("name", "config"), _with_layer_types(model), "config dict"
    path = Path(model)
    if (path / "config.json").is_file():
        return path.name, _with_layer_types(_text_config(path)), str(path / "config.json")
    name = str(model)
    built = ROOT / "models" / name
    if (built / "config.json").is_file():
        return name, _with_layer_types(_text_config(built)), str((built / "config.json").relative_to(ROOT))
    if name in HAND_WRITTEN:
        return name, _with_layer_types(HAND_WRITTEN[name]), "hand-written shapes"
    from tailreplay_eval.models import PRESETS

    if name in PRESETS:
        return name, preset_config(name), "preset spec (tailreplay_eval/models.py; not built)"
    raise SystemExit(f"{model}: no config.json there, and not a preset or one of {', '.join(HAND_WRITTEN)}")


def serving_dtype(config: dict, flags: list[str]) -> torch.dtype:
    """The model's activation dtype: --dtype, and under 'auto' the checkpoint's, float32 downcast to float16
    (bfloat16 for Gemma), as SGLang's `_get_and_verify_dtype` decides."""
    dtype = _flag(flags, "--dtype", "auto").lower()
    if dtype != "auto":
        return DTYPES[dtype]
    checkpoint = config.get("dtype") or config.get("torch_dtype")
    checkpoint = DTYPES.get(checkpoint, torch.float32) if isinstance(checkpoint, str) else torch.float32
    if checkpoint == torch.float32:
        return torch.bfloat16 if config.get("model_type", "").startswith("gemma") else torch.float16
    return checkpoint


def kv_dtype(config: dict, flags: list[str]) -> torch.dtype:
    """The KV pool's dtype: --kv-cache-dtype, else the serving dtype."""
    kv = _flag(flags, "--kv-cache-dtype", "auto")
    return serving_dtype(config, flags) if kv == "auto" else DTYPES[kv]


def hidden_dtype(cfg: TailReplayConfig, config: dict, flags: list[str]) -> torch.dtype:
    """The hidden store's dtype: --tail-replay-hidden-dtype, 'auto' being the serving dtype (as the server decides
    it, `TailReplayConfig.hidden_torch_dtype(model_config.dtype)`)."""
    return cfg.hidden_torch_dtype(serving_dtype(config, flags))


@contextlib.contextmanager
def _config_dir(config: dict):
    """A directory holding `config` as config.json, for the plugin's flag parser (which reads the model's layout)."""
    with tempfile.TemporaryDirectory(prefix="memory-config.") as d:
        (Path(d) / "config.json").write_text(json.dumps(config))
        yield Path(d)


def tail_replay_config(model_path, flags: list[str]) -> TailReplayConfig:
    """The Tail-Replay config a server started with these flags runs, parsed by the plugin's own flag parser."""
    if isinstance(model_path, dict):
        with _config_dir(model_path) as d:
            return tail_replay_config(d, flags)
    parser = argparse.ArgumentParser(add_help=False)
    add_cli_args(parser)
    args, _ = parser.parse_known_args(list(flags))
    args.model_path = str(model_path)
    return config_from_args(args)


def _kda_dims(config: dict) -> tuple[int, int, int] | None:
    """(heads, head_dim, conv width) of a KDA layer as SGLang's `KimiLinearStateShape.create` gets them: Kimi's
    linear_attn_config, GLM-5-Next's linear_* fields, or Bailing's attention heads where use_kda (a
    short_conv_kernel_size); None for another mixer."""
    if "linear_attn_config" in config:
        kda = config["linear_attn_config"]
        return kda["num_heads"], kda["head_dim"], kda["short_conv_kernel_size"]
    if "linear_num_heads" in config:
        return config["linear_num_heads"], config["linear_head_dim"], config["linear_conv_kernel_dim"]
    if config.get("short_conv_kernel_size"):
        return config["num_attention_heads"], config["head_dim"], config["short_conv_kernel_size"]
    return None


def _mamba2_form(config: dict) -> tuple[int, int, int, int, int, int]:
    """(intermediate size, groups, heads, head dim, state size, conv width) of one recurrent layer, in the terms of
    SGLang's `Mamba2StateShape.create` (conv over intermediate | B | C with 2 x groups x state, SSM [heads, head dim,
    state]): GDN's (configs/qwen3_next.py: intermediate V x HV, groups HK, state K), KDA's (KimiLinearStateShape's
    q | k | v conv over heads x head_dim each = groups of heads, state head_dim), Bailing's lightning layers' (no
    conv), or Mamba2's (Nemotron-H's or Granite's names)."""
    if kda := _kda_dims(config):
        heads, head_dim, conv_width = kda
        return heads * head_dim, heads, heads, head_dim, head_dim, conv_width
    if "jet" in config.get("efficient_attention_config", {}):  # Jet-Nemotron (configs/jet_nemotron.py): GDN's form
        jet = config["efficient_attention_config"]["jet"]  # over its value heads; JetBlock uses the v channels only
        heads, head_k = jet["num_heads"], jet["head_dim"]
        head_v = int(head_k * jet["expand_v"])
        return heads * head_v, heads, heads, head_v, head_k, jet["conv_size"]
    if config.get("cca"):  # ZAYA1's CCA (configs/zaya.py mamba2_cache_params): conv[0] over q || k, no SSM state
        width = config.get("cca_time0", 2) + config.get("cca_time1", 2) - 1  # conv[1]: in `mamba_slot_bytes`
        return (config["num_attention_heads"] + config["num_key_value_heads"]) * config["head_dim"], 0, 0, 0, 0, width
    if "conv_L_cache" in config:  # LFM2's short conv: a conv over the hidden size, no SSM state
        return config["hidden_size"], 0, 0, 0, 0, config["conv_L_cache"]
    if "layer_group_size" in config:  # BailingHybridConfig.mamba2_cache_params without KDA: conv_kernel 1
        return 0, 0, config["num_attention_heads"], config["head_dim"], config["head_dim"], 1
    if "linear_num_key_heads" in config:
        value_heads, value_dim = config["linear_num_value_heads"], config["linear_value_head_dim"]
        return (value_heads * value_dim, config["linear_num_key_heads"], value_heads, value_dim,
                config["linear_key_head_dim"], config["linear_conv_kernel_dim"])
    heads = config.get("mamba_num_heads") or config["mamba_n_heads"]
    head_dim = config.get("mamba_head_dim") or config["mamba_d_head"]
    groups = config.get("n_groups") or config.get("mamba_n_groups") or 1
    state = config.get("ssm_state_size") or config["mamba_d_state"]
    width = config.get("conv_kernel") or config.get("mamba_d_conv") or 4
    return heads * head_dim, groups, heads, head_dim, state, width


def _divide(n: int, tp: int) -> int:
    """n / tp, which must be whole (SGLang's `distributed.utils.divide`)."""
    if n % tp:
        raise ValueError(f"{n} is not divisible by TP {tp}")
    return n // tp


def _recurrent_shape(config: dict, tp: int = 1) -> tuple[int, int, int]:
    """(conv channels, conv width, SSM state values) of one recurrent layer on one of `tp` attention-TP ranks, as
    `Mamba2StateShape.create(tp_world_size=tp)` shards them (configs/mamba_utils.py:195-230): heads and conv channels
    split over the ranks, groups that do not split extended to tp first (`extra_groups_for_head_shards`: Granite's
    one group is replicated on every rank). KDA's shape (KimiLinearStateShape.create, :324-349) splits the same way."""
    intermediate, groups, heads, head_dim, state, width = _mamba2_form(config)
    groups += 0 if groups % tp == 0 else tp - groups
    return _divide(intermediate + 2 * groups * state, tp), width, _divide(heads, tp) * head_dim * state


def kv_heads_per_rank(config: dict, tp: int = 1) -> int:
    """KV heads one of `tp` attention-TP ranks keeps: SGLang's `ModelConfig.get_num_kv_heads` (configs/
    model_config.py:1700-1711), max(1, heads // tp): replicated where there are fewer heads than ranks."""
    return max(1, config["num_key_value_heads"] // tp)


def kv_values_per_layer(config: dict, tp: int = 1) -> int:
    """KV values one FA layer keeps per token on one of `tp` attention-TP ranks: K and V of the rank's KV heads, or
    MLA's compressed latent and shared rope key (Kimi Linear: SGLang's MLA pool keeps kv_lora_rank +
    qk_rope_head_dim), which every rank keeps whole (`_compute_cell_size`'s MLA branch has no TP term)."""
    if config.get("kv_lora_rank"):
        return config["kv_lora_rank"] + config["qk_rope_head_dim"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]  # OLMo: no head_dim
    return 2 * kv_heads_per_rank(config, tp) * head_dim


def indexer_bytes_per_token(config: dict, n_fa: int) -> int:
    """Bytes per token of the sparse-attention indexer caches, which SGLang adds to the KV cell
    (`pool_configurator._compute_cell_size`). QSA (Qwen4-Exp, `QSATokenToKVPool.qsa_bytes_per_token`): one
    compressed key of indexer_kv_heads x indexer_head_dim per indexer_compress_ratio tokens per layer, bfloat16
    (`--qsa-indexer-dtype auto`). DSA (GLM-5-Next with an index_topk, `_compute_dsa_indexer_cell_size`):
    index_head_dim float8 bytes plus a float32 scale per 128, one row per index_kpool tokens, on every layer (with
    index_topk_freq 1 no layer shares its top-k)."""
    if config.get("indexer_n_heads") is not None:
        return config["indexer_kv_heads"] * config["indexer_head_dim"] * 2 // config["indexer_compress_ratio"] * n_fa
    if config.get("index_topk") is not None:
        dim = config["index_head_dim"]
        return -(-(dim + dim // 128 * 4) // config.get("index_kpool", 1)) * n_fa
    return 0


def residual_streams(config: dict) -> int:
    """Streams of the residual, all of which a group's input is: Qwen4-Exp's hyper-connections (hc_count), GLM-5-Next's
    mHC where mhc is on (hc_mult); 1 for a plain residual."""
    if config.get("hc_count"):
        return config["hc_count"]
    return config.get("hc_mult", 1) if config.get("mhc") else 1


def attn_res_bank_rows(config: dict, stored_first_layers: tuple[int, ...]) -> int:
    """Hidden rows per token the store keeps besides the groups' inputs for attention residuals (attn_res_block_size
    B, Kimi K3): layer i reads a softmax mix of the rows banked at layers 0, B, 2B, ... below it and its running
    prefix (`AttnResidual.forward`, layers/attn_residual.py). Tail-Replay stores a group's prefix and takes the rows
    below it from earlier groups' replays in the same pass (`families/attn_res_kda.py`), which bank every row at a
    KDA layer; a row banked at an attention layer would have to be stored (`layout` refuses such a checkpoint), and
    row 0 is the embeddings. So: the banking attention layers below the last stored group."""
    block = config.get("attn_res_block_size")
    if not block or not stored_first_layers:
        return 0
    banked = banking_attention_layers(layer_kinds(ConfigAttrs(config)), block)
    return sum(1 for layer in banked if 0 < layer < max(stored_first_layers))


def mamba_slot_bytes(config: dict, n_gdn_layers: int, tp: int = 1) -> dict:
    """Bytes of one mamba slot on one of `tp` attention-TP ranks (SGLang's `mamba_cache_per_req`), split into conv
    and SSM states."""
    conv_dim, width, ssm_values = _recurrent_shape(config, tp)
    conv_dtype = DTYPES[os.environ.get("SGLANG_MAMBA_CONV_DTYPE", "bfloat16")]
    ssm_dtype = DTYPES[os.environ.get("SGLANG_MAMBA_SSM_DTYPE") or config.get("mamba_ssm_dtype") or "float32"]
    conv = conv_dim * (width - 1) * conv_dtype.itemsize
    if config.get("cca"):  # ZAYA1's conv[1]: the layer's last input, whole on every rank
        conv += config["hidden_size"] * conv_dtype.itemsize
    ssm = ssm_values * ssm_dtype.itemsize
    return {"conv_bytes": conv * n_gdn_layers, "ssm_bytes": ssm * n_gdn_layers,
            "total_bytes": (conv + ssm) * n_gdn_layers, "conv_dtype": _dtype_name(conv_dtype),
            "ssm_dtype": _dtype_name(ssm_dtype)}


def anchor_intervals(cfg: TailReplayConfig, flags: list[str], intervals=None) -> tuple[int, ...]:
    """The intervals to tabulate: those asked for, else the one the flags name, else ANCHOR_INTERVALS; none with
    anchors off (exact budget 0), and none for an interval of 0 (request-end and chunk-end anchors only)."""
    if not cfg.anchored:
        return ()
    if intervals is None:
        named = _flag(flags, "--tail-replay-anchor-interval") is not None
        intervals = (cfg.anchor_interval,) if named else ANCHOR_INTERVALS
    return tuple(n for n in intervals if n > 0)


def account(model, flags: list[str] | tuple = (), intervals=None) -> dict:
    """Memory per cached token and per recurrent state for this model served with these flags.

    `model`: a checkpoint directory, a preset or hand-written model name, or a config dict (see `resolve_model`).
    `intervals`: the anchor intervals N to amortise a slot over (default: see `anchor_intervals`)."""
    flags = list(flags)
    name, config, source = resolve_model(model)
    served, kv = serving_dtype(config, flags), kv_dtype(config, flags)
    refused = _refusal(config)
    n_fa, n_gdn, stored = _layer_counts(config)
    # The store and anchors as a Tail-Replay server with these flags would have them (defaults included), also when
    # the flags are a stock server's; for a refused model paper mode on the device (nothing anchored or replayed).
    cfg = (TailReplayConfig(exact_budget=0, hidden_tier="device") if refused
           else tail_replay_config(config, [*flags, "--enable-tail-replay"]))
    kv_per_token = n_fa * kv_values_per_layer(config) * kv.itemsize
    indexer = indexer_bytes_per_token(config, n_fa)
    streams, bank_rows = residual_streams(config), attn_res_bank_rows(config, stored)
    hidden = hidden_dtype(cfg, config, flags)
    rows = len(stored) * streams + bank_rows  # hidden-wide rows per token
    hidden_per_token = hidden_store.bytes_per_token_of(rows, config["hidden_size"], hidden)
    slot = mamba_slot_bytes(config, n_gdn)
    stock = kv_per_token + indexer  # SGLang's KV cell
    paper = stock + hidden_per_token
    return {
        "model": name, "config_source": source, "flags": shlex.join(flags), **({"refused": refused} if refused else {}),
        "fa_layers": n_fa, "gdn_layers": n_gdn, "stored_groups": len(stored),
        "residual_streams": streams, "attn_res_bank_rows": bank_rows, "stored_rows": rows,
        "fa_kv_kind": "MLA latent" if config.get("kv_lora_rank") else "K and V",
        "serving_dtype": _dtype_name(served), "kv_dtype": _dtype_name(kv),
        "hidden_dtype_flag": cfg.hidden_dtype, "hidden_dtype": _dtype_name(hidden), "hidden_tier": cfg.hidden_tier,
        "fa_kv_bytes_per_token": kv_per_token,
        "indexer_bytes_per_token": indexer,
        "tail_replay_hidden_bytes_per_token": hidden_per_token,
        "hiddens_per_kv": hidden_per_token / kv_per_token,
        "tail_replay_bytes_per_cached_token": paper,
        # Tokens a pool holds at equal device memory in paper mode, as a share of stock's.
        "tokens_that_fit": stock / paper,
        "mamba_slot": slot,
        "stock_slots_per_running_request": {"no_buffer": 1, "extra_buffer": 3},
        "stock_slots_per_checkpoint": 1,
        "tail_replay_slots_per_running_request": 1,
        # Anchored replay keeps stock's request-end and chunk-end states as anchors; paper mode keeps none.
        "tail_replay_slots_per_checkpoint": 1 if cfg.anchored else 0,
        # One stock checkpoint costs as much as the hiddens of this many cached tokens.
        "hidden_tokens_per_mamba_slot": slot["total_bytes"] / hidden_per_token,
        "kv_tokens_per_mamba_slot": slot["total_bytes"] / kv_per_token,
        # Per cached token, without the states held per checkpoint / request end (one slot each, above).
        "stock_bytes_per_cached_token": stock,
        "paper_bytes_per_cached_token": paper,
        "anchors": {
            "anchored": cfg.anchored, "anchor_interval": cfg.anchor_interval, "exact_budget": cfg.exact_budget,
            "bytes_per_anchor": slot["total_bytes"],
            "intervals": [{"interval": n, "anchor_bytes_per_token": slot["total_bytes"] / n,
                           "tail_replay_bytes_per_cached_token": paper + slot["total_bytes"] / n}
                          for n in anchor_intervals(cfg, flags, intervals)],
        },
    }


def _refusal(config: dict) -> str | None:
    """Tail-Replay's start-up refusal of this model, or None where it is served: the layout check's message for a
    hybrid SGLang serves that Tail-Replay refuses (`architectures.REFUSED`, its reason in the message; Falcon-H1's
    names its store's cost). Any other architecture raises that message: there is no row to make of it."""
    try:
        HybridLayout.from_hf_config(ConfigAttrs(config))
    except ValueError as e:
        if (config.get("architectures") or [None])[0] not in REFUSED:
            raise
        return str(e)
    return None


def _layer_counts(config: dict) -> tuple[int, int, tuple[int, ...]]:
    """(FA layers, recurrent layers, first layer of each stored group). A parallel hybrid (Falcon-H1) has attention
    beside its recurrent mixer in every layer, so every layer would be a group and all but the first (fed by the
    embeddings) would store their input."""
    if is_parallel_hybrid(config.get("architectures") or ()):
        n = config["num_hidden_layers"]
        return n, n, tuple(range(1, n))
    if config.get("cca"):  # ZAYA1: every CCA layer keeps KV and a conv state; one group fed by the embeddings
        n = sum(1 for kind in layer_kinds(ConfigAttrs(config)) if kind == LINEAR)
        return n, n, ()
    layout = HybridLayout(tuple(BLOCK_KINDS.get(t, t) for t in config["layer_types"]), config["hidden_size"])
    return (layout.layer_types.count(FULL), layout.layer_types.count(LINEAR),
            tuple(g.first_layer for g in layout.stored_groups))


def serving_dtype_name(model, flags: list[str] | tuple = ()) -> str:
    """The activation dtype a server of `model` with `flags` runs in, by name ("bfloat16")."""
    return _dtype_name(serving_dtype(resolve_model(model)[1], list(flags)))


def device_bytes_per_token(model_path: Path, server_args: list[str], system_flags: tuple) -> int:
    """Bytes a server charges its device per pooled token: SGLang's KV cell (FA KV + any indexer cache), plus the
    stored hiddens unless they are on the host tier (`--tail-replay-hidden-tier host`)."""
    acc = account(model_path, [*server_args, *system_flags])
    on_device = "--enable-tail-replay" in system_flags and "host" not in system_flags
    return acc["stock_bytes_per_cached_token"] + (acc["tail_replay_hidden_bytes_per_token"] if on_device else 0)


def account_for_configs(model_path: Path, configs: dict[str, tuple | None], server_args: list[str]) -> dict:
    """The accounting for the first Tail-Replay server's flags (its hidden dtype), else for the common flags."""
    flags = next((f for f in configs.values() if f and "--enable-tail-replay" in f), server_args)
    return account(model_path, flags)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def table(acc: dict, title: str = "memory per cached token and per recurrent state") -> Table:
    t = Table(title=title)
    t.add_column("what")
    t.add_column("bytes", justify="right")
    t.add_column("note")
    slot, anchors = acc["mamba_slot"], acc.get("anchors", {})
    if "refused" in acc:
        t.add_row("Tail-Replay refuses this model", "", acc["refused"].split(". Supported:")[0]
                  + ". The Tail-Replay rows below are what it would cost.")
    t.add_row("FA KV per token", _size(acc["fa_kv_bytes_per_token"]),
              f"{acc['fa_layers']} FA layers, {acc['fa_kv_kind']}, {acc['kv_dtype']}; stock and Tail-Replay alike")
    if acc.get("indexer_bytes_per_token"):
        t.add_row("indexer cache per token", _size(acc["indexer_bytes_per_token"]),
                  "the attention layers' sparse-attention indexer; in SGLang's KV cell, stock and Tail-Replay alike")
    t.add_row("Tail-Replay hiddens per token", _size(acc["tail_replay_hidden_bytes_per_token"]),
              f"{_rows(acc)} x hidden, {acc['hidden_dtype']} (--tail-replay-hidden-dtype "
              f"{acc.get('hidden_dtype_flag', '?')}), + 8 B token id; {acc['hiddens_per_kv']:.1f}x the FA KV")
    t.add_row("Tail-Replay per cached token", _size(acc["tail_replay_bytes_per_cached_token"]),
              f"KV + indexer + hiddens; all of it in paper mode (exact budget 0); tokens that fit at equal "
              f"memory: {acc['tokens_that_fit']:.1%} of stock's")
    t.add_row("one mamba slot = one anchor", _size(slot["total_bytes"]),
              f"{acc['gdn_layers']} recurrent layers: conv {_size(slot['conv_bytes'])} ({slot['conv_dtype']}) + "
              f"SSM {_size(slot['ssm_bytes'])} ({slot['ssm_dtype']})")
    for row in anchors.get("intervals", []):
        n = row["interval"]
        t.add_row(f"anchored, N={n}, per cached token", _size(row["tail_replay_bytes_per_cached_token"]),
                  f"KV + hiddens + slot/{n} = {_size(row['anchor_bytes_per_token'])}, while every anchor is kept")
    t.add_row("stock, per running request", _size(slot["total_bytes"]), "1 slot (no_buffer); 3 with extra_buffer")
    t.add_row("stock, per cached checkpoint", _size(slot["total_bytes"]),
              f"1 slot = hiddens of {acc['hidden_tokens_per_mamba_slot']:.0f} tokens "
              f"= FA KV of {acc['kv_tokens_per_mamba_slot']:.0f} tokens")
    if anchors.get("anchored", False):
        interval = anchors["anchor_interval"]
        every = f", every {interval} tokens of a prefill" if interval else " (interval anchors off)"
        t.add_row("Tail-Replay, per running request / anchor", _size(slot["total_bytes"]),
                  f"1 slot each; anchors where requests and prefill chunks end{every}")
    else:
        t.add_row("Tail-Replay, per running request", _size(slot["total_bytes"]),
                  "1 slot; anchors off (exact budget 0): no slot per cached prefix")
    return t


def _rows(acc: dict) -> str:
    """What the stored rows are: the groups' inputs (every stream of a hyper-connection residual) and banked rows."""
    rows = f"{acc['stored_groups']} stored groups"
    if acc.get("residual_streams", 1) > 1:
        rows += f" x {acc['residual_streams']} streams"
    if acc.get("attn_res_bank_rows"):
        rows += f" + {acc['attn_res_bank_rows']} attention-residual bank rows"
    return rows


def all_table(accs: list[dict], title: str = "bytes per cached token") -> Table:
    """One row per model: KV, hiddens, the slot (= one anchor), and per cached token stock / paper / anchored at
    each interval (the union of the models' intervals)."""
    t = Table(title=title)
    t.add_column("model\nflags", no_wrap=True)
    t.add_column("dtypes\nKV / hid", no_wrap=True)
    t.add_column("FA KV\n/token", justify="right")
    t.add_column("hiddens\n/token", justify="right")
    t.add_column("slot =\n1 anchor", justify="right")
    t.add_column("stock\nKV (+1 slot\nper ckpt)", justify="right")
    t.add_column("paper B=0\nKV + hid", justify="right")
    t.add_column("fit\n(paper)", justify="right")
    intervals = sorted({row["interval"] for acc in accs for row in acc["anchors"]["intervals"]})
    for n in intervals:
        t.add_column(f"anchored\nN={n}\n(+slot/{n})", justify="right", no_wrap=True)
    for acc in accs:
        by_n = {row["interval"]: row for row in acc["anchors"]["intervals"]}
        star = "*" if acc["config_source"] == "hand-written shapes" else ""
        refused = "refused" in acc  # the store columns say what it would cost
        paper = _size(acc["paper_bytes_per_cached_token"])
        indexer = acc.get("indexer_bytes_per_token", 0)
        cells = [f"{acc['model']}{star}{' (refused)' if refused else ''}\n{acc['flags']}",
                 f"{acc['kv_dtype']}\n{acc['hidden_dtype']}",
                 _size(acc["fa_kv_bytes_per_token"]) + (f"\n+{_size(indexer)} idx" if indexer else ""),
                 f"{_size(acc['tail_replay_hidden_bytes_per_token'])}\n{acc['hiddens_per_kv']:.1f}x KV",
                 _size(acc["mamba_slot"]["total_bytes"]), _size(acc["stock_bytes_per_cached_token"]),
                 f"would be\n{paper}" if refused else paper, f"{acc['tokens_that_fit']:.1%}"]
        for n in intervals:
            row = by_n.get(n)
            cells.append(f"{_size(row['tail_replay_bytes_per_cached_token'])}\n"
                         f"(+{_size(row['anchor_bytes_per_token'])})" if row else "-")
        t.add_row(*cells, end_section=True)
    return t


def anchors_in_prefix(tokens: int, interval: int, chunk: int = CHUNK_TOKENS) -> int:
    """Anchors a prefill of `tokens` tokens in `chunk`-token chunks leaves: one where each chunk ends, plus one
    every `interval` tokens inside each chunk (`anchors.offsets`: counted from the chunk's start)."""
    count = 0
    for start in range(0, tokens, chunk):
        extend = min(chunk, tokens - start)
        count += 1 + (len(range(interval, extend, interval)) if interval > 0 else 0)
    return count


def prefix_cost(acc: dict, tokens: int, checkpoints: int) -> dict:
    """Bytes to keep a cached prefix: stock holds KV + its checkpoints, Tail-Replay KV + hiddens (paper mode), and
    anchored at each interval also its anchors."""
    slot = acc["mamba_slot"]["total_bytes"]
    paper = tokens * acc["tail_replay_bytes_per_cached_token"]
    anchored = {}
    for row in acc.get("anchors", {}).get("intervals", []):
        n = anchors_in_prefix(tokens, row["interval"])
        anchored[row["interval"]] = {"anchors": n, "bytes": paper + n * slot}
    return {"stock_bytes": tokens * acc["fa_kv_bytes_per_token"] + checkpoints * slot,
            "tail_replay_bytes": paper, "tail_replay_anchored": anchored}


# ---- per attention-TP rank (bench/memory.py --per-rank) ----

PER_RANK_MODELS = ("Qwen3.5-4B", "Qwen3.6-27B", "Nemotron-H-8B", "Granite-4.0-H-Small", "Kimi-Linear-48B-A3B",
                   *FRONTIER)
TP_SIZES = (1, 2, 4, 8)
PER_RANK_TIERS = ("device", "host")
PER_RANK_HIDDEN_DTYPES = ("bfloat16", "float8_e4m3fn", "int4")
PER_RANK_NOTE = (
    "Per cached token on ONE attention-TP rank, served at --dtype auto (bfloat16 KV), computed from the shapes "
    "(not measured). KV: K and V of max(1, kv_heads // TP) heads (SGLang's get_num_kv_heads: replicated where "
    "there are fewer heads than ranks); an MLA latent and the sparse-attention indexer caches (QSA, DSA) whole on "
    "every rank. Slot: one mamba slot (= one anchor) on the rank, conv and SSM states split over TP as SGLang's "
    "Mamba2StateShape / KimiLinearStateShape do. Store, sharded: each rank keeps hidden/TP columns of every stored "
    "row (+ 8 B token id; float8: + 8 B scale slot per row; int4: half a byte per value + 2 B per 32 values, in "
    "whole 8-byte words), whole rows where the hidden size does not split and "
    "for MLA models with a HiCache storage backend (= the replicated column). Store, replicated: whole rows on "
    "every rank, as before sharding. Host tier: the store in host memory, the device holds the KV (+ indexer) "
    "alone. fit = tokens a rank's pool holds at equal device memory, as a share of stock's. Projection: a model "
    "Tail-Replay refuses; its store would keep every hyper-connection stream")


def store_shards(config: dict, tp: int, hicache_storage: bool = False) -> int:
    """Ranks the hidden store's rows split over (`lifecycle.store_shard`): all `tp` attention-TP ranks, or 1 (whole
    rows) where the hidden size does not split evenly, and for an MLA model with a HiCache storage backend."""
    whole = config["hidden_size"] % tp or (hicache_storage and config.get("kv_lora_rank"))
    return 1 if whole else tp


def _store_rows(config: dict, stored: tuple[int, ...]) -> int:
    """Hidden-wide rows stored per token: every residual stream of each stored group's input, and banked rows."""
    return len(stored) * residual_streams(config) + attn_res_bank_rows(config, stored)


def _placed(stock: int, store: int, tier: str) -> dict:
    """Device and host bytes per token of a Tail-Replay rank whose store costs `store`, and the tokens that fit at
    equal device memory against stock's `stock`."""
    device = stock + (store if tier == "device" else 0)
    return {"store_bytes_per_token": store, "device_bytes_per_token": device,
            "host_bytes_per_token": store if tier == "host" else 0, "tokens_that_fit": stock / device}


def account_per_rank(model, tp: int, tier: str = "device", hidden_dtype: str = "bfloat16",
                     hicache_storage: bool = False, flags: list[str] | tuple = ("--dtype", "auto")) -> dict:
    """Memory per cached token on one of `tp` attention-TP ranks of a server with `flags` (its `--dtype` sets the
    KV's), the store on `tier` in `hidden_dtype`: stock (KV + indexer on the device), Tail-Replay with the store
    sharded over the ranks (as served) and replicated (every rank whole rows), and one mamba slot on the rank."""
    name, config, source = resolve_model(model)
    flags = list(flags)
    n_fa, n_gdn, stored = _layer_counts(config)
    kv = n_fa * kv_values_per_layer(config, tp) * kv_dtype(config, flags).itemsize
    indexer = indexer_bytes_per_token(config, n_fa)
    rows, dtype, hidden = _store_rows(config, stored), getattr(torch, hidden_dtype), config["hidden_size"]
    shards = store_shards(config, tp, hicache_storage)
    stock = kv + indexer
    mla = bool(config.get("kv_lora_rank"))
    return {
        "model": name, "config_source": source, "projection": _refusal(config) is not None, "tp": tp,
        "tier": tier, "hidden_dtype": hidden_dtype, "kv_dtype": _dtype_name(kv_dtype(config, flags)),
        "fa_layers": n_fa, "recurrent_layers": n_gdn, "stored_rows": rows,
        "fa_kv_kind": "MLA latent (replicated)" if mla else "K and V",
        "kv_heads_per_rank": None if mla else kv_heads_per_rank(config, tp),
        "kv_heads": None if mla else config["num_key_value_heads"],
        "fa_kv_bytes_per_token": kv, "indexer_bytes_per_token": indexer,
        "mamba_slot_bytes": mamba_slot_bytes(config, n_gdn, tp)["total_bytes"], "store_shards": shards,
        "stock": {"device_bytes_per_token": stock, "host_bytes_per_token": 0},
        "sharded": _placed(stock, hidden_store.bytes_per_token_of(rows, hidden // shards, dtype), tier),
        "replicated": _placed(stock, hidden_store.bytes_per_token_of(rows, hidden, dtype), tier),
    }


def per_rank_rows(models=PER_RANK_MODELS, tps=TP_SIZES, tiers=PER_RANK_TIERS,
                  hidden_dtypes=PER_RANK_HIDDEN_DTYPES) -> list[dict]:
    return [account_per_rank(m, tp, tier, dtype)
            for tier in tiers for dtype in hidden_dtypes for m in models for tp in tps]


def _kv_cell(row: dict) -> str:
    heads = ("MLA, replicated" if row["kv_heads"] is None
             else f"{row['kv_heads_per_rank']} of {row['kv_heads']} heads")
    idx = f"\n+{_size(row['indexer_bytes_per_token'])} idx" if row["indexer_bytes_per_token"] else ""
    return f"{_size(row['fa_kv_bytes_per_token'])}{idx}\n{heads}"


def per_rank_table(rows: list[dict], title: str) -> Table:
    """One line per model and TP size: the rank's KV, slot and store, and its device and host bytes per token
    (Tail-Replay sharded / replicated, stock) and the tokens that fit against stock."""
    t = Table(title=title)
    t.add_column("model", no_wrap=True)
    t.add_column("TP", justify="right")
    t.add_column("KV / rank", justify="right")
    t.add_column("slot /\nrank", justify="right")
    t.add_column("store / rank\nsharded\nreplicated", justify="right")
    t.add_column("device / token\nsharded\nreplicated\nstock", justify="right")
    t.add_column("host / token\nsharded\nreplicated", justify="right")
    t.add_column("fit vs stock\nsharded\nreplicated", justify="right")
    last_tp = max(row["tp"] for row in rows)
    for row in rows:
        sharded, replicated = row["sharded"], row["replicated"]
        t.add_row(f"{row['model']}{' (projection)' if row['projection'] else ''}", str(row["tp"]), _kv_cell(row),
                  _size(row["mamba_slot_bytes"]),
                  f"{_size(sharded['store_bytes_per_token'])}\n{_size(replicated['store_bytes_per_token'])}",
                  "\n".join(_size(b) for b in (sharded["device_bytes_per_token"],
                                               replicated["device_bytes_per_token"],
                                               row["stock"]["device_bytes_per_token"])),
                  f"{_size(sharded['host_bytes_per_token'])}\n{_size(replicated['host_bytes_per_token'])}",
                  f"{sharded['tokens_that_fit']:.1%}\n{replicated['tokens_that_fit']:.1%}",
                  end_section=row["tp"] == last_tp)
    return t
