"""Which model architectures Tail-Replay serves: an allow-list, so that every other one fails closed at start-up.

SGLang decides that a model is a hybrid by its config class (`configs/hybrid_arch.py`, the linear-attention
registry), and a new architecture's config can pass for an old one: Qwen3.8-Flash-Next's text config subclasses
Qwen3-Next's, so its layer list reads as one GDN stack although its residual stream is four hyper-connection
streams and its attention layers carry an indexer cache. Reading such a model with an old family's recipe would
replay the wrong input and label the result exact. So an architecture is served only where it is listed in `SERVED`
with its recurrent family, each with its tests (docs/models.md); every other one is refused naming itself and the
served list, with the reason `REFUSED` records where the architecture is one SGLang 0.5.23 serves as a hybrid.
`tests/test_architectures.py` walks every hybrid architecture SGLang 0.5.23 registers through this check, and checks
that docs/models.md's table says the same.
"""

GDN, MAMBA2, KDA, LIGHTNING, SHORT_CONV = "gdn", "mamba2", "kda", "lightning", "short_conv"
HYPER_GDN = "gdn_hc"  # GDN under hyper-connection streams (families/hyper_gdn.py)
JET = "jet"  # Jet-Nemotron's JetBlock: a gated delta rule over dynamically convolved values (families/jet.py)
KDA_ATTN_RES = "kda_attn_res"  # KDA under attention residuals (Kimi K3; families/attn_res_kda.py)
MHC_KDA = "kda_mhc"  # KDA under manifold-constrained hyper-connection streams (GLM-5.3-Flash; families/mhc_kda.py)
CCA = "cca"  # ZAYA1's CCA attention: a conv window and the previous input per request beside its KV (families/cca.py)

# architecture -> the recurrent family that replays it (`families/`), and what it is, for the messages and the docs
SERVED = {
    "Qwen3_5ForCausalLM": (GDN, "Qwen3.5, text-only"),
    "Qwen3_5MoeForCausalLM": (GDN, "Qwen3.5 MoE, text-only"),
    "Qwen3_5ForConditionalGeneration": (GDN, "Qwen3.5, vision-language (as Qwen publishes it)"),
    "Qwen3_5MoeForConditionalGeneration": (GDN, "Qwen3.5 MoE, vision-language"),
    "Qwen3NextForCausalLM": (GDN, "Qwen3-Next"),
    "OlmoHybridForCausalLM": (GDN, "OLMo-Hybrid (SGLang model from this package)"),
    "NemotronHForCausalLM": (MAMBA2, "Nemotron-H"),
    "NemotronHPuzzleForCausalLM": (MAMBA2, "Nemotron-H Puzzle (per-layer MoE sizes)"),
    "GraniteMoeHybridForCausalLM": (MAMBA2, "Granite-4.0-H"),
    "KimiLinearForCausalLM": (KDA, "Kimi Linear"),
    "BailingMoeV3ForCausalLM": (KDA, "Ling-3.0 (Bailing KDA + gated MLA)"),
    "BailingMoeV2_5ForCausalLM": (LIGHTNING, "Ling-2.5 / Ring-2.5 (Bailing lightning attention + MLA)"),
    "Lfm2ForCausalLM": (SHORT_CONV, "LFM2 (gated short conv + GQA)"),
    "Lfm2MoeForCausalLM": (SHORT_CONV, "LFM2-MoE (gated short conv + GQA, MoE)"),
    "Lfm2VlForConditionalGeneration": (SHORT_CONV, "LFM2-VL (LFM2 under a SigLIP2 vision tower)"),
    "InternS2PreviewForConditionalGeneration": (GDN, "InternS2-Preview (SGLang's Qwen3.5 MoE vision-language class "
                                                     "unchanged)"),
    "MiniCPMV4_6ForConditionalGeneration": (GDN, "MiniCPM-V 4.6 (a Qwen3.5 language model under MiniCPM-V's vision "
                                                  "tower)"),
    "MiniCPMV4_7ForConditionalGeneration": (GDN, "MiniCPM-V 4.7 (MiniCPM-V 4.6 with canvas M-RoPE)"),
    "NemotronH_Omni_Reasoning_V3": (MAMBA2, "Nemotron-H Omni (Nemotron-H under a RADIO vision tower; images, "
                                           "without its audio tower)"),
    "NemotronH_Nano_VL_V2": (MAMBA2, "Nemotron-H Nano VL V2 (Nemotron-H under a RADIO vision tower; images)"),
    "NemotronH_Nano_Omni_Reasoning_V3": (MAMBA2, "Nemotron-H Nano Omni V3 (Nemotron-H under a RADIO vision tower; "
                                                "images, without its audio tower)"),
    "JetNemotronForCausalLM": (JET, "Jet-Nemotron (JetBlock: a gated delta rule over dynamically convolved values; "
                                    "full attention)"),
    "Qwen4ExpForConditionalGeneration": (HYPER_GDN, "Qwen3.8-Flash-Next (GDN + QSA sparse attention under 4 "
                                                    "hyper-connection streams; per-layer embeddings)"),
    "ZayaForCausalLM": (CCA, "ZAYA1 (CCA attention, whose conv over q and k and delayed value keep a few tokens' "
                             "state per request beside its KV; MoE)"),
    "KimiK3LinearForCausalLM": (KDA_ATTN_RES, "Kimi K3, text (KDA + gated NoPE MLA under attention residuals; "
                                              "without the latent MoE)"),
    "KimiK3ForConditionalGeneration": (KDA_ATTN_RES, "Kimi K3 with its MoonViT3d vision tower (images; the text "
                                                     "model as KimiK3LinearForCausalLM)"),
    "Glm5NextForConditionalGeneration": (MHC_KDA, "GLM-5.3-Flash (KDA + DSA-indexed MLA under 4 mHC streams, MoE; "
                                                  "dense attention up to index_topk on a CPU)"),
}

# SGLang renames the target's architecture to its MTP head's for NEXTN's draft model (`ModelConfig`, is_draft_model):
# a draft of a served target is served with it, never on its own (the launcher reads the target's config.json).
DRAFTS = {
    "Qwen3_5ForCausalLMMTP": "Qwen3_5ForConditionalGeneration",
    "Qwen3NextForCausalLMMTP": "Qwen3NextForCausalLM",
    "Qwen4ExpForCausalLMMTP": "Qwen4ExpForConditionalGeneration",
    # Ling-3.0's and Ling-2.5's; on Ling-2.5 the target's family (lightning) refuses speculative decoding
    "BailingMoeForCausalLMNextN": "BailingMoeV3ForCausalLM",
    "Glm5NextForConditionalGenerationNextN": "Glm5NextForConditionalGeneration",
}

_NO_FAMILY = "a mixer with no replay family here yet"
_UNTESTED = "not served until it has the tests every served family has"
_DRAFT = "an MTP draft of a model Tail-Replay does not serve"

# Every other architecture SGLang 0.5.23 serves as a hybrid (its hybrid_arch.py configs and linear-attention
# registry): why Tail-Replay refuses it, read from the model's structure in SGLang's model file.
REFUSED = {
    # the 2026 frontier hybrids (../shared/notes/frontier-hybrids-2026-12-06.md)
    "BailingMoeV3VLForConditionalGeneration": ("Ling-3.0 vision-language: KDA + gated MLA; " + _UNTESTED),
    # the other hybrids
    "FalconH1ForCausalLM": (
        "Falcon-H1: attention and Mamba2 side by side in every layer, so every layer would be a group and the store "
        "would keep every layer's input (6x the KV cache on Falcon-H1-7B)"),
    "Lfm2BidirectionalModel": ("LFM2 as a bidirectional encoder: no generation, no prefix to cache"),
    "Lfm2DSparkDraftModel": (_DRAFT + " (LFM2)"),
    "NemotronHForCausalLMMTP": ("Nemotron-H's MTP draft: speculative decoding is served on GDN and KDA models only "
                                "(not on Mamba2)"),
    "JetVLMForConditionalGeneration": ("JetVLM: Jet-Nemotron under a vision tower; " + _UNTESTED),
    "MiniCPMSALAForCausalLM": ("MiniCPM-SALA: lightning and sparse attention, " + _NO_FAMILY),
    "InternS2MobiusForConditionalGeneration": ("InternS2-Mobius: a Qwen3.5-layout GDN hybrid with shared expert "
                                               "banks; " + _UNTESTED),
    "GigaChat35ForCausalLM": ("GigaChat3.5: a GDN hybrid from SGLang's linear-attention registry; " + _UNTESTED),
    "GigaChat35ForCausalLMNextN": (_DRAFT + " (GigaChat3.5)"),
    "InklingForConditionalGeneration": ("Inkling: a Mamba2 hybrid whose SGLang model needs cutlass (it does not "
                                        "import on a CPU); " + _UNTESTED),
    "InklingForConditionalGenerationMTP": (_DRAFT + " (Inkling)"),
    "MambaForCausalLM": ("Mamba: a pure state-space model, no attention layer, so there is no KV to keep beside "
                         "the states; stock SGLang's state checkpoints are all a hit could reuse"),
    "Mamba2ForCausalLM": ("Mamba2: a pure state-space model, no attention layer (as MambaForCausalLM)"),
    "FalconMambaForCausalLM": ("Falcon-Mamba: a pure state-space model, no attention layer (as MambaForCausalLM)"),
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture is not on the allow-list; the message names it and what is served."""


def decoder_stack(model):
    """The decoder (`layers`, `embed_tokens`) in the model object SGLang runs: `model.model`, except under two vision
    wrappers: LFM2-VL's language model (`Lfm2ForCausalLM`) at `language_model`, and MiniCPM-V, whose runner holds the
    version's module with its Qwen3.5 decoder at `llm` (SGLang's `Qwen3_5ForCausalLM` is the decoder itself)."""
    if hasattr(model, "llm"):
        return model.llm
    return model.language_model.model if hasattr(model, "language_model") else model.model


def served_list() -> str:
    return "; ".join(f"{what} ({arch}, {family})" for arch, (family, what) in SERVED.items())


def family_of(architectures) -> str:
    """The recurrent family of the checkpoint's first architecture (SGLang loads that one), or
    `UnsupportedArchitectureError` naming it, why where known, and every served architecture."""
    arch = (list(architectures) or ["(none in config.json)"])[0]
    arch = DRAFTS.get(arch, arch)
    if arch in SERVED:
        return SERVED[arch][0]
    why = REFUSED.get(arch)
    reason = f": {why}" if why else " (not a hybrid Tail-Replay knows; it needs linear-attention layers)"
    raise UnsupportedArchitectureError(f"--enable-tail-replay does not serve {arch}{reason}. "
                                       f"Supported: {served_list()}")
