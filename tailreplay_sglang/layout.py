"""Which layers form Tail-Replay groups, and what the hidden store keeps per token.

A hybrid model is a stack of groups: group 0 is the recurrent layers before the first full-attention (FA) layer, fed
by the token embeddings; every later group is the layers following one FA layer, up to its last recurrent layer.
For each group after group 0 the store keeps, per token, the residual-stream value entering the group's first layer
(the FA layer's output hidden); replaying a group needs nothing else.

Three recurrent mixers (`HybridLayout.mixer`, each replayed by its family in `families/`): Gated DeltaNet (Qwen3.5,
Qwen3-Next, OLMo-Hybrid: each decoder layer is
a GDN mixer and its MLP) and Mamba2 (Granite-4.0-H: each layer a Mamba2 or attention mixer and its MoE + shared MLP,
`layer_types` mamba / attention; Nemotron-H: every layer is one stage, a Mamba2 mixer `M`, attention `*`, MLP `-` or
MoE `E`, as its `hybrid_override_pattern` spells it). A Nemotron-H group is the run of layers between two
attention layers cut after its last Mamba2 layer: the MLP layers between its Mamba2 layers feed them and are
replayed, those after the last one feed nothing the states depend on.

Kimi Linear's and Ling-3.0's KDA (`KDA`) and Ling-2.5's lightning-attention (`LIGHTNING`) layers are laid out as
Qwen3.5's GDN ones (a linear or MLA mixer, then a dense MLP or MoE, in every layer); Kimi's `linear_attn_config` lists
the KDA layers, 1-indexed, Ling's `layer_group_size` puts an MLA layer at every layer_group_size-th.

Vision-language checkpoints (a `vision_config`: Qwen3.5 as Qwen publishes it) store group 0's input too. There the
first layer's input is not a function of the token id: SGLang puts the vision tower's features in the rows of image
tokens (whose ids it clamps to vocab - 1), and a request may bring its own `input_embeds`. Storing that input costs
one hidden per token more; replaying from re-embedded ids would rebuild the state of every group 0 from the wrong
input wherever a replay covers an image.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from tailreplay_sglang.architectures import (CCA, GDN, HYPER_GDN, JET, KDA, KDA_ATTN_RES, LIGHTNING,  # noqa: F401
                                             MAMBA2, MHC_KDA, SHORT_CONV, family_of, served_list)

LINEAR, FULL, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
SUPPORTED = served_list()
# Nemotron-H's pattern letters (SGLang's configs/nemotron_h.py) and its layers_block_type names (SGLang's, then HF's).
PATTERN_KINDS = {"M": LINEAR, "*": FULL, "-": MLP, "E": MOE}
BLOCK_KINDS = {"mamba": LINEAR, "attention": FULL, "linear_attention": LINEAR, "full_attention": FULL, "mlp": MLP,
               "moe": MOE, "conv": LINEAR,  # conv: LFM2's short-conv layers
               # Qwen3.8-Flash-Next's QSA layers: full attention with an indexer, whose cache is per token like the KV
               "indexed_attention": FULL, "qwen_sparse_attention": FULL,
               "jet": LINEAR, "attn": FULL}  # Jet-Nemotron's JetBlock and attention layers
PARALLEL_HYBRIDS = ("FalconH1ForCausalLM",)  # attention and Mamba2 side by side in every layer


@dataclass(frozen=True)
class Group:
    index: int
    layers: tuple[int, ...]  # consecutive layer ids replayed, through the last recurrent one (state-only)
    recurrent_layers: tuple[int, ...]  # those with a recurrent mixer (every layer of the group for GDN and KDA)

    @property
    def first_layer(self) -> int:
        return self.layers[0]


@dataclass(frozen=True)
class HybridLayout:
    layer_types: tuple[str, ...]
    hidden_size: int
    stores_embeddings: bool = False  # group 0's input is stored too (vision-language checkpoints)
    mixer: str = GDN  # the recurrent mixer: GDN, MAMBA2, KDA or LIGHTNING
    chunk_size: int | None = None  # Mamba2: the SSD scan's chunk (mamba_chunk_size), the grid of its per-chunk states
    # LFM2's short conv: its width (conv_L_cache); ZAYA1's CCA: its two convs' joint width (cca_time0 + cca_time1 - 1).
    # Either layer's state is a function of its last conv_kernel - 1 inputs.
    conv_kernel: int | None = None
    # the residual stream's hyper-connection streams (Qwen3.8-Flash-Next: hc_count; GLM-5.3-Flash: hc_mult), all stored
    streams: int = 1
    # recurrent layers that start a group wherever they sit (Qwen3.8-Flash-Next's PLE layers: `group_starts`)
    group_starts: tuple[int, ...] = ()

    @property
    def row_width(self) -> int:
        """Values per stored row: a group's input is every stream of the residual."""
        return self.hidden_size * self.streams

    @property
    def groups(self) -> tuple[Group, ...]:
        """Runs of layers between FA layers (also cut before each of `group_starts`), cut after their last recurrent
        layer (runs without one dropped); run i is group i."""
        runs, current = [], []
        for layer_id, kind in enumerate(self.layer_types):
            if kind == FULL or layer_id in self.group_starts:
                runs.append(current)
                current = []
            if kind != FULL:
                current.append(layer_id)
        runs.append(current)
        groups = []
        for run in runs:
            recurrent = tuple(i for i in run if self.layer_types[i] == LINEAR)
            if recurrent:
                groups.append(Group(len(groups), tuple(i for i in run if i <= recurrent[-1]), recurrent))
        return tuple(groups)

    @property
    def stored_groups(self) -> tuple[Group, ...]:
        """Groups whose replay input comes from the hidden store: every group not fed by the embeddings, and that
        one too where the embeddings are stored."""
        first_fa = self.layer_types.index(FULL) if FULL in self.layer_types else len(self.layer_types)
        return tuple(g for g in self.groups if g.first_layer > first_fa or g.index > 0 or self.stores_embeddings)

    @classmethod
    def from_hf_config(cls, config) -> "HybridLayout":
        """From a transformers config (or its `text_config` for vision-language checkpoints)."""
        # NVIDIA's VL wrappers name theirs `llm_config`, and SGLang's config class keeps their vision config raw
        text = getattr(config, "text_config", None) or getattr(config, "llm_config", None) or config
        _refuse_unsupported_mixers(getattr(config, "architectures", None) or (), text)
        vision = getattr(config, "vision_config", None) or getattr(config, "raw_vision_config", None)
        _refuse_audio(getattr(config, "sound_config", None) or getattr(config, "audio_config", None))
        if vision is not None:
            _require_no_deepstack(getattr(vision, "deepstack_visual_indexes", None) or [])
        mixer = mixer_of(getattr(config, "architectures", None) or ())
        return cls(layer_kinds(text), text.hidden_size, stores_embeddings=vision is not None, mixer=mixer,
                   chunk_size=mamba_chunk_size(text) if mixer == MAMBA2 else None,
                   conv_kernel=conv_kernel(text, mixer),
                   streams=hyper_streams(text, mixer), group_starts=ple_layers(text))

    @classmethod
    def from_model_path(cls, model_path: str) -> "HybridLayout":
        config_file = Path(model_path) / "config.json"
        if config_file.exists():  # local checkpoint: no transformers import needed at flag-parsing time
            raw = json.loads(config_file.read_text())
            text = text_config_of(raw)
            _refuse_unsupported_mixers(raw.get("architectures") or (), ConfigAttrs(text))
            vision = raw.get("vision_config")
            _refuse_audio(raw.get("sound_config") or raw.get("audio_config"))
            if vision is not None:
                _require_no_deepstack(vision.get("deepstack_visual_indexes") or [])
            mixer = mixer_of(raw.get("architectures") or ())
            return cls(layer_kinds(ConfigAttrs(text)), text["hidden_size"], stores_embeddings=vision is not None,
                       mixer=mixer, chunk_size=mamba_chunk_size(ConfigAttrs(text)) if mixer == MAMBA2 else None,
                       conv_kernel=conv_kernel(ConfigAttrs(text), mixer),
                       streams=hyper_streams(ConfigAttrs(text), mixer), group_starts=ple_layers(ConfigAttrs(text)))
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(model_path))

    def require_hybrid(self, model_path: str) -> "HybridLayout":
        if LINEAR not in self.layer_types:
            raise ValueError(f"--enable-tail-replay needs a hybrid model with linear-attention layers; "
                             f"{model_path} has none. Supported: {SUPPORTED}")
        return self


def _require_no_deepstack(indexes) -> None:
    """Qwen3-VL's deepstack adds visual features to the outputs of the first layers, inside group 0, which the
    replay does not add back. Qwen3.5's vision-language checkpoints have none."""
    if indexes:
        raise ValueError(f"--enable-tail-replay does not replay deepstack visual features (vision_config."
                         f"deepstack_visual_indexes={list(indexes)}). Supported: {SUPPORTED}")


def _refuse_audio(audio_config) -> None:
    """An audio tower's rows would reach group 0's stored input as an image's do, but no audio checkpoint has been
    served with its tests here (Nemotron-H Omni is served with images only)."""
    if audio_config:
        raise ValueError("--enable-tail-replay does not serve checkpoints with an audio tower yet (this config has "
                         "sound_config / audio_config): audio rows are not tested. Supported: " + SUPPORTED)


def text_config_of(raw: dict) -> dict:
    """The language model's part of a config.json: `text_config` (vision-language checkpoints), `llm_config`
    (NVIDIA's Nemotron-H VL and Omni), else the whole of it."""
    return raw.get("text_config") or raw.get("llm_config") or raw


class ConfigAttrs:
    def __init__(self, d: dict):
        self.__dict__.update(d)


def _refuse_unsupported_mixers(architectures, text_config) -> None:
    """Hybrids served by SGLang that Tail-Replay does not replay, each with its reason.

    Falcon-H1 runs attention and Mamba2 side by side in every layer, so every layer is its own group and the store
    would keep every layer's input: hidden_size values per layer per token, against the KV's 2 x kv_heads x
    head_dim. The ratio is computed from the checkpoint's config and reported (Falcon-H1-7B: 3072 values against
    2 x 2 x 128 = 512, 6x; `bench/memory.py --all` has its row); the store would displace that much KV."""
    if "Qwen4ExpForConditionalGeneration" in architectures:
        kinds = layer_kinds(text_config)
        other = [i + 1 for i in ple_layers(text_config) if kinds[i] != LINEAR]
        if other:
            raise ValueError(f"--enable-tail-replay replays Qwen3.8-Flash-Next's per-layer embeddings on GDN layers "
                             f"(as transformers allows them); ple_layer_ids {other} are not GDN layers. "
                             f"Supported: {SUPPORTED}")
    if "BailingMoeV3ForCausalLM" in architectures and getattr(text_config, "short_conv_kernel_size", None) is None:
        raise ValueError("--enable-tail-replay replays Ling-3.0's KDA layers, which a Bailing config declares with "
                         "short_conv_kernel_size; this one has none (its layers would be built as lightning "
                         "attention, Ling-2.5's mixer, which SGLang serves as BailingMoeV2_5ForCausalLM). "
                         f"Supported: {SUPPORTED}")
    if "JetNemotronForCausalLM" in architectures and "swa" in (getattr(text_config, "layer_types", None) or ()):
        raise ValueError("--enable-tail-replay does not serve Jet-Nemotron checkpoints with sliding-window attention "
                         "layers (layer_types 'swa') yet: SGLang's hybrid SWA pools beside the JetBlock states are "
                         f"untested with Tail-Replay. Supported: {SUPPORTED}")
    if "Glm5NextForConditionalGeneration" in architectures and not getattr(text_config, "mhc", False):
        raise ValueError("--enable-tail-replay replays GLM-5.3-Flash's layers under their mHC streams; this config "
                         "has mhc off (SGLang's default where config.json omits it), which builds a plain residual "
                         f"stream no test here serves. Supported: {SUPPORTED}")
    if "BailingMoeV2_5ForCausalLM" in architectures:
        _refuse_unsupported_lightning(text_config)
    if {"KimiK3LinearForCausalLM", "KimiK3ForConditionalGeneration"} & set(architectures):
        _refuse_unsupported_attn_residuals(text_config)
    if is_parallel_hybrid(architectures):
        heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        kv_values = 2 * text_config.num_key_value_heads * head_dim
        raise ValueError(f"--enable-tail-replay does not replay Falcon-H1: attention and Mamba2 share every layer, so "
                         f"every layer would be a group and the hidden store would keep {text_config.hidden_size} "
                         f"values per layer per token beside the KV cache's {kv_values} "
                         f"({text_config.hidden_size / kv_values:.1f}x the KV cache, which it would displace). "
                         f"Supported: {SUPPORTED}")


def _refuse_unsupported_lightning(text_config) -> None:
    """Ling-2.5's lightning layers are replayed through SGLang's seg_la kernel, the default `linear_backend`; the
    `minimax` backend keeps its states through another kernel path (GPU-only), which the interval anchors do not
    read. A short conv would make SGLang build KDA states for a model whose layers are lightning."""
    backend = getattr(text_config, "linear_backend", "seg_la")
    if backend != "seg_la":
        raise ValueError(f"--enable-tail-replay replays Ling-2.5's lightning layers with linear_backend seg_la "
                         f"(SGLang's default); this config sets linear_backend={backend!r}. Supported: {SUPPORTED}")
    if getattr(text_config, "short_conv_kernel_size", None) is not None:
        raise ValueError("--enable-tail-replay: this BailingMoeV2_5ForCausalLM config has short_conv_kernel_size, "
                         "which makes SGLang allocate KDA states for lightning layers (a KDA Bailing is Ling-3.0, "
                         f"BailingMoeV3ForCausalLM). Supported: {SUPPORTED}")


def _refuse_unsupported_attn_residuals(text_config) -> None:
    """Kimi K3's replay (`families/attn_res_kda.py`) takes the rows banked below a group from earlier groups' replays
    in the same pass, so every banking layer (l % attn_res_block_size == 0) must be a KDA layer; an MLA layer's
    row would be in no replay. The latent MoE takes the running residual into its own output (`prefix_sum`) and the
    full-rank KDA gate projects through another fused path: neither is built or tested here."""
    block = getattr(text_config, "attn_res_block_size", None)
    if block is None:
        raise ValueError("--enable-tail-replay serves Kimi K3 with its attention residuals; this "
                         f"Kimi K3 config has no attn_res_block_size. Supported: {SUPPORTED}")
    mla = banking_attention_layers(layer_kinds(text_config), block)
    if mla:
        raise ValueError(f"--enable-tail-replay: Kimi K3's banking layers (every attn_res_block_size={block}-th) "
                         f"must be KDA layers, whose replay rebuilds the banked row; layers {mla} are MLA. "
                         f"Supported: {SUPPORTED}")
    if getattr(text_config, "routed_expert_hidden_size", None) is not None:
        raise ValueError("--enable-tail-replay does not serve Kimi K3 with the latent MoE (routed_expert_hidden_size) "
                         f"yet: not tested. Supported: {SUPPORTED}")
    if (getattr(text_config, "linear_attn_config", None) or {}).get("use_full_rank_gate"):
        raise ValueError("--enable-tail-replay does not serve Kimi K3 with use_full_rank_gate yet: its KDA gate "
                         f"projects through a path the replay does not call. Supported: {SUPPORTED}")


def banking_attention_layers(kinds: tuple[str, ...], block: int) -> list[int]:
    """The layers that bank an attention-residual row (every `block`-th, from 0) and are not recurrent: no replay
    rebuilds their rows."""
    return [i for i in range(0, len(kinds), block) if kinds[i] != LINEAR]


def mamba_chunk_size(text_config) -> int:
    """The Mamba2 scan's chunk as SGLang reads it: `mamba_chunk_size`, else Nemotron-H's `chunk_size`, else SGLang's
    default (DEFAULT_MAMBA_CHUNK_SIZE of its NemotronHConfig, 256; Granite's config defaults to 256 too)."""
    return getattr(text_config, "mamba_chunk_size", None) or getattr(text_config, "chunk_size", None) or 256


def is_parallel_hybrid(architectures) -> bool:
    """Attention and a recurrent mixer side by side in every layer (Falcon-H1): no groups to replay, refused."""
    return any(a in PARALLEL_HYBRIDS for a in architectures)


def mixer_of(architectures) -> str:
    """The served architecture's family (`architectures.SERVED`); any other architecture is refused by name."""
    return family_of(architectures)


def conv_kernel(text_config, mixer: str) -> int | None:
    """The width whose last inputs (less one) are a layer's whole state: LFM2's conv (`conv_L_cache`, 3 by
    default) or ZAYA1's two CCA convs together; None for the other mixers."""
    if mixer == SHORT_CONV:
        return getattr(text_config, "conv_L_cache", 3)
    if mixer == CCA:
        return getattr(text_config, "cca_time0", 2) + getattr(text_config, "cca_time1", 2) - 1
    return None


def hyper_streams(text_config, mixer: str) -> int:
    """The residual's streams: Qwen3.8-Flash-Next's `hc_count`, GLM-5.3-Flash's `hc_mult` (with `mhc` on); 1 else."""
    if mixer == HYPER_GDN:
        return getattr(text_config, "hc_count", 1)
    if mixer == MHC_KDA and getattr(text_config, "mhc", False):
        return getattr(text_config, "hc_mult", 1)
    return 1


def ple_layers(text_config) -> tuple[int, ...]:
    """Qwen3.8-Flash-Next's per-layer-embedding layers (`ple_layer_ids`, 1-indexed), 0-indexed. Each starts a group:
    the streams entering it, before its PLE adds to them, are then a stored group input, from which the replay
    rebuilds its conv state (`families/ple.py`)."""
    return tuple(sorted({int(i) - 1 for i in (getattr(text_config, "ple_layer_ids", None) or ())}))


def layer_kinds(text_config) -> tuple[str, ...]:
    if getattr(text_config, "cca", False):  # ZAYA1: its CCA attention layers hold a conv state beside their KV and
        layers = getattr(text_config, "zaya_layers", None)  # are the recurrent ones; the others are MoE
        n = len(layers) if layers else text_config.num_hidden_layers
        return tuple(LINEAR if (layers[i] == "a" if layers else i % 2 == 0) else MOE for i in range(n))
    linear = getattr(text_config, "linear_attn_config", None)
    if linear:  # Kimi Linear as Moonshot writes it: 1-indexed KDA layers, the rest MLA; GLM-5.3-Flash's (SGLang's
        kda = set(linear["kda_layers"])  # Glm5NextTextConfig builds it from layer_types): 0-indexed
        first = 0 if str(getattr(text_config, "model_type", "")).startswith("glm5") else 1
        return tuple(LINEAR if i + first in kda else FULL for i in range(text_config.num_hidden_layers))
    period = getattr(text_config, "layer_group_size", None)
    if period is not None:  # Bailing (Ling) as inclusionAI writes it: MLA every period-th layer, or a per-layer list
        n = text_config.num_hidden_layers  # whose 1s mark the linear layers (configs/bailing_hybrid.py)
        if isinstance(period, list):
            return tuple(LINEAR if kind == 1 else FULL for kind in period)
        return tuple(FULL if (i + 1) % period == 0 else LINEAR for i in range(n))
    pattern = getattr(text_config, "hybrid_override_pattern", None)
    if pattern:  # Nemotron-H as NVIDIA writes it
        return tuple(PATTERN_KINDS[c] for c in pattern)
    blocks = getattr(text_config, "layers_block_type", None)
    if blocks:  # Nemotron-H as transformers 5 writes it
        return tuple(BLOCK_KINDS[b] for b in blocks)
    types = getattr(text_config, "layer_types", None)
    if types:  # Granite-4.0-H spells its kinds mamba / attention
        return tuple(BLOCK_KINDS.get(t, t) for t in types)
    interval = getattr(text_config, "full_attention_interval", None)
    n = getattr(text_config, "num_hidden_layers", 0)
    if interval:
        return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n))
    return (FULL,) * n
