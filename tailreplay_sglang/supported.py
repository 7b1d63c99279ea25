"""What of SGLang Tail-Replay supports, checked at start-up so that anything else fails closed.

Eight checks, each raising with a message that names what to change:
- `check_version` (launcher): the SGLang release the hooks were written against (`hooks.py` patches private methods);
- `check_resolved` (scheduler, before the radix cache is built): SGLang's configuration *after* its own
  post-processing (`auto` strategies resolved, deprecated spellings mapped), against the values Tail-Replay is built
  and tested for (`SUPPORTED`, and on a PD server `DISAGGREGATED` for its role); the command-line checks in
  `plugin.config_from_args` see only what was typed;
- `check_anchor_prefill` (scheduler, same point): the linear-attention prefill kernel the model runner resolved is
  one the interval anchors are read from;
- `check_speculative_family` (scheduler, same point): speculative decoding only on the families it is tested on;
- `check_dp_attention_family` (scheduler, same point): attention DP only on the families whose replay is wired for it;
- `check_dp_attention_exchange` (scheduler, same point): under attention DP, what the replay's row exchange needs
  (every rank runs a forward each step and agrees whether it extends; the MoE takes the gathered rows as they are);
- `check_anchor_graphs` (scheduler, same point): no prefill graph captures the extend interval anchors are written in;
- `hooks.verify_applied` (scheduler, same point): every hook of the runtime took effect. SGLang only logs a hook that
  fails to apply, and a server missing one would serve hits without a replay.
"""

from tailreplay_sglang.config import TailReplayConfigError

SGLANG_VERSION = "0.5.23"

# ServerArgs field -> (values Tail-Replay supports, the flag a user changes, why). Fields SGLang derives from
# several flags (attn_dp_size) are named by the flags that set them.
SUPPORTED = {
    "disable_radix_cache": ((False,), "--disable-radix-cache", "Tail-Replay is a radix cache"),
    # HiCache: the hidden store and the anchors travel with the KV (cache/hierarchy.py), tested with the host tier
    # and the `file` and `mooncake` storage backends (tests/test_hicache*.py, test_mooncake_store.py); buffer_only
    # stages host copies the store does not follow
    "hicache_host_memory_mode": (("cache",), "--hicache-host-memory-mode", "buffer_only is not wired"),
    # Speculative decoding: NEXTN (SGLang resolves it to EAGLE) with the checkpoint's own MTP head, and NGRAM. The
    # hidden store is written by the verify at the drafts' KV slots and follows a draft tree's moves
    # (`lifecycle.move_hidden_rows`). EAGLE topk > 1 (multi-step draft trees) has no torch_native draft decode here.
    "speculative_algorithm": ((None, "NEXTN", "EAGLE", "NGRAM"), "--speculative-algorithm",
                              "NEXTN and NGRAM are supported and tested; EAGLE3, DFLASH, DSPARK and the rest are not"),
    "speculative_eagle_topk": ((None, 1), "--speculative-eagle-topk",
                               "EAGLE draft trees are not tested (SGLang's CPU draft decode is a chain here)"),
    "speculative_draft_model_path": ((None,), "--speculative-draft-model-path",
                                     "a separate draft model is not tested (NEXTN's MTP head in the checkpoint is)"),
    "attn_cp_size": ((1,), "--attn-cp-size", "context parallelism splits a sequence's KV and hiddens"),
    "dcp_size": ((1,), "--dcp-size", "decode context parallelism splits a sequence's KV"),
    "pp_size": ((1,), "--pp-size", "a pipeline stage holds only some groups' layers"),
    # PD: the prefill server replays as a colocated one; the decode server runs the decode side (disaggregation.py)
    "disaggregation_mode": (("null", "prefill", "decode"), "--disaggregation-mode", "not a mode SGLang 0.5.23 has"),
    "enable_lora": ((None, False), "--enable-lora", "the replay runs the base weights"),
    "lora_paths": ((None, [], {}), "--lora-paths", "the replay runs the base weights"),
    "enable_int8_mamba_checkpoint": ((False,), "--enable-int8-mamba-checkpoint", "anchors must be exact states"),
    "enable_streaming_session": ((False,), "--enable-streaming-session", "sessions hold slots outside the match"),
    "enable_session_radix_cache": ((False,), "--enable-session-radix-cache", "sessions hold slots outside the match"),
    "moe_a2a_backend": (("none",), "--moe-a2a-backend", "the replay completes MoE sums with TP all-reduces only"),
    # auto resolves to no_buffer or extra_buffer (extra_buffer wherever the overlap scheduler or paging is on);
    # extra_buffer_lazy (track slots taken at boundaries) is tested like extra_buffer (tests/test_production_path.py)
    "mamba_radix_cache_strategy": (("auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"),
                                   "--mamba-radix-cache-strategy", "not a strategy SGLang 0.5.23 has"),
    # page sizes dividing the 64-token GDN chunk keep every track point and chunk-aligned anchor on a page boundary
    # (a hit is matched to the page and the rest of it recomputed, as stock does); None: SGLang's default, 1
    "page_size": ((None, 1, 2, 4, 8, 16, 32, 64), "--page-size", "pages larger than the 64-token GDN chunk"),
    "enable_mixed_chunk": ((False,), "--enable-mixed-chunk", "mixed prefill/decode batches are not tested"),
    "enable_two_batch_overlap": ((False,), "--enable-two-batch-overlap", "split batches are not replayed"),
    "enable_single_batch_overlap": ((False,), "--enable-single-batch-overlap", "not tested"),
    # Attention DP (--enable-dp-attention / --attn-dp-size) and expert parallelism (--ep-size, the standard
    # all-reduce dispatcher): the replay's feed-forward blocks run as one pass of every rank (`dp_attention.py`), and
    # an EP MoE block's sum is completed with the TP all-reduce (tests/test_dp_attention.py); the family check is
    # `check_dp_attention_family`. GPU-only all-to-all backends stay refused (moe_a2a_backend above).
    # The replay addresses the KV pool and the hidden store by the request's slot ids as the tree holds them.
    "enable_unified_memory": ((False,), "--enable-unified-memory", "slot ids become virtual (not replayed)"),
    "enable_page_major_kv_layout": ((False,), "--enable-page-major-kv-layout", "slot ids become virtual"),
    "enable_unified_cache_external_linker": ((False,), "--enable-unified-cache-external-linker",
                                             "KV loaded from outside comes without its hiddens or taint"),
    "enable_lmcache": ((False,), "--enable-lmcache", "the tail_replay cache backend would bypass LMCache"),
    "hicache_storage_backend": ((None, "file", "mooncake"), "--hicache-storage-backend",
                                "the hidden pages go through SGLang's page API, tested with `file` and `mooncake`"),
    "enable_pdmux": ((False,), "--enable-pdmux", "prefill/decode multiplexing is not tested"),
    "enable_mis": ((False,), "--enable-mis", "multi-item scoring turns the radix cache off"),
    # dynamo would trace the capture hooks (index_put into the store from inside a compiled decode graph): untested
    "enable_torch_compile": ((False,), "--enable-torch-compile",
                             "the capture hooks under torch.compile are not tested"),
    "enable_linear_replayssm": ((False,), "--enable-linear-replayssm", "SGLang's own recurrent-state replay"),
    "enable_linear_replayssm_spec": ((False,), "--enable-linear-replayssm-spec", "SGLang's own recurrent-state replay"),
    "mamba_max_states_per_path": ((-1,), "--mamba-max-states-per-path",
                                  "a cap on a path's states that drops anchors (not tested)"),
}


# Mooncake is the transfer engine tested (its TCP transport, `mooncake_tcp`, on the CPU route); `fake` moves no
# data (decode benchmarks), NIXL, Mori and Ascend are GPU/NPU transports not tested with the relay
_TRANSFER_BACKEND = (("mooncake", "mooncake_tcp"), "--disaggregation-transfer-backend",
                     "Tail-Replay's PD relay is tested over Mooncake's transfer engine")
# What a PD server with Tail-Replay does not support beyond SUPPORTED, by --disaggregation-mode. A decode server
# resolves --disable-radix-cache itself unless --disaggregation-decode-enable-radix-cache is given: both are fine.
DISAGGREGATED = {
    "prefill": {
        "disaggregation_transfer_backend": _TRANSFER_BACKEND,
        "enable_hierarchical_cache": ((False,), "--enable-hierarchical-cache",
                                      "HiCache on a PD prefill server is not tested with Tail-Replay"),
        "speculative_algorithm": ((None,), "--speculative-algorithm",
                                  "speculative decoding in PD is not tested with Tail-Replay"),
    },
    "decode": {
        "disaggregation_transfer_backend": _TRANSFER_BACKEND,
        "disable_radix_cache": ((False, True), "--disaggregation-decode-enable-radix-cache", ""),
        "enable_hierarchical_cache": ((False,), "--enable-hierarchical-cache",
                                      "decode-side HiCache is not tested with the decode radix cache's taint"),
        "disaggregation_decode_enable_offload_kvcache": ((False,), "--disaggregation-decode-enable-offload-kvcache",
                                                         "offloaded decode KV comes back without its taint"),
        "speculative_algorithm": ((None,), "--speculative-algorithm",
                                  "speculative decoding in PD is not tested with Tail-Replay"),
    },
}


class UnsupportedConfigError(TailReplayConfigError):
    """SGLang runs in a configuration Tail-Replay does not support; the message names the flag."""


def check_version(version: str) -> None:
    if version != SGLANG_VERSION:
        raise UnsupportedConfigError(f"--enable-tail-replay supports sglang=={SGLANG_VERSION} only (its hooks patch "
                                     f"that release's internals); this is sglang {version}")


def unsupported(server_args) -> list[str]:
    """One message per field of SGLang's resolved configuration that Tail-Replay does not support."""
    problems = []
    mode = getattr(server_args, "disaggregation_mode", "null")
    for field, (allowed, flag, why) in {**SUPPORTED, **DISAGGREGATED.get(mode, {})}.items():
        value = getattr(server_args, field, allowed[0])
        if value not in allowed:
            problems.append(f"{flag} (is {value!r}; supported: {' or '.join(repr(a) for a in allowed)}): {why}")
    return problems


def check_speculative_family(family, server_args) -> None:
    """Speculative decoding with Tail-Replay is tested on the families whose `speculative` is set: GDN (Qwen3.5,
    Qwen3-Next), GDN under hyper-connections (Qwen3.8-Flash-Next), KDA (Ling-3.0) and KDA under mHC streams
    (GLM-5.3-Flash), with their MTP heads; the others' verify paths are not (Nemotron-H's MTP on Mamba2: on a CPU its
    ops refuse a verify mid-serving)."""
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if algorithm and family is not None and not family.speculative:
        raise UnsupportedConfigError(
            f"--speculative-algorithm {algorithm} with --enable-tail-replay is tested on GDN and KDA models (Qwen3.5, "
            f"Qwen3-Next, Qwen3.8-Flash-Next, Ling-3.0, GLM-5.3-Flash) only; this model's recurrent layers are "
            f"{family.name}")


def check_dp_attention_family(family, server_args) -> None:
    """Attention DP needs the family's replay to run its feed-forward blocks as one pass of every rank
    (`Family.dp_attention`, `feed_forwards`): wired for GDN models (Qwen3.5 dense and MoE, Qwen3-Next)."""
    attn_dp = getattr(server_args, "attn_dp_size", 1) or 1
    if attn_dp > 1 and family is not None and not family.dp_attention:
        raise UnsupportedConfigError(
            f"--enable-dp-attention (attention DP size {attn_dp}) with --enable-tail-replay is supported on GDN "
            f"models (Qwen3.5, Qwen3-Next); this model's recurrent layers are {family.name}")


def check_dp_attention_exchange(server_args, skip_all_gather: bool, mask_dp_pad_moe: bool) -> None:
    """Under attention DP each replay pass exchanges every rank's rows in one all-gather of the TP group, and its
    feed-forward blocks run over the gathered rows (`dp_attention.py`). Refused, each by name (multi-server review
    F3, F4), where that pairing or those rows break:
    - `--dwdp-size` (and `SGLANG_SCHEDULER_SKIP_ALL_GATHER`, which it sets): ranks skip idle forwards and decide
      alone whether a step extends, so a replaying rank waits forever in the exchange;
    - the FlashInfer-cutlass FP4 MoE all-gather: the MoE dispatch gathers its input itself, with the outer batch's
      sizes, not the replay's;
    - `SGLANG_OPT_MASK_DP_PAD_MOE`: masks MoE rows by the outer batch's padding layout;
    - speculative decoding: its draft forwards join the exchange, with forward sequences that differ by rank under
      SGLang's DP prefill coordination; not tested."""
    dwdp = getattr(server_args, "dwdp_size", 1) or 1
    if dwdp > 1:  # SGLang sets attention DP from it while it launches (arg_groups/parallel_hook.py)
        raise UnsupportedConfigError(f"--dwdp-size {dwdp} with --enable-tail-replay is not supported: it runs "
                                     f"attention DP with ranks that skip forwards, so the replay's row exchange "
                                     f"would wait for them")
    attn_dp = getattr(server_args, "attn_dp_size", 1) or 1
    if attn_dp <= 1:
        return
    problems = []
    if skip_all_gather:
        problems.append("SGLANG_SCHEDULER_SKIP_ALL_GATHER (whether a step extends is decided per rank, so the "
                        "replay's row exchange would pair with no peer)")
    if (getattr(server_args, "quantization", None) == "modelopt_fp4"
            and getattr(server_args, "moe_runner_backend", "auto") in ("auto", "flashinfer_cutlass")
            and not getattr(server_args, "disable_flashinfer_cutlass_moe_fp4_allgather", False)):
        problems.append("the FlashInfer-cutlass FP4 MoE all-gather (it gathers the rows the replay already gathered, "
                        "with the outer batch's sizes): pass --disable-flashinfer-cutlass-moe-fp4-allgather")
    if mask_dp_pad_moe:
        problems.append("SGLANG_OPT_MASK_DP_PAD_MOE (it masks MoE rows by the outer batch's padding)")
    if getattr(server_args, "speculative_algorithm", None):
        problems.append(f"--speculative-algorithm {server_args.speculative_algorithm} (draft forwards would join "
                        f"the replay's row exchange; not tested under attention DP)")
    if problems:
        raise UnsupportedConfigError(f"--enable-dp-attention (attention DP size {attn_dp}) with --enable-tail-replay "
                                     f"does not support " + "; ".join(problems))


def check_anchor_prefill(family, backends) -> None:
    """The linear-attention prefill kernel the model runner resolved (`runner.linear_attn_backends`, after SGLang's
    own per-GPU default) is one whose per-chunk states the family's interval-anchor hooks read: otherwise every
    anchor planned would be dropped after live ones were evicted for it. The launcher pins it (`plugin.hand_off`);
    this catches whatever changed it since."""
    readable = getattr(family, "anchor_prefill_backends", None)
    if readable is None or backends is None:
        return
    resolved = getattr(backends.prefill, "value", backends.prefill)
    if resolved not in readable:
        raise UnsupportedConfigError(
            f"--linear-attn-prefill-backend (resolved {resolved!r}; supported: {' or '.join(map(repr, readable))}): "
            f"Tail-Replay's {family.name} interval anchors are read from that kernel's per-chunk states; set it, or "
            f"--tail-replay-anchor-interval 0")


def check_anchor_graphs(family, graph_config, on_cuda: bool) -> None:
    """Interval anchors are written by hooks on the linear-attention extend (the conv and the chunked prefill); a
    prefill CUDA graph that captures that extend runs them once, at capture, and never at replay, so every planned
    anchor would be evicted for and then dropped. SGLang's default breakable prefill graph runs the GDN extend
    eagerly between its segments; the `full` backend captures it, and so does the breakable one for KDA, whose
    extend runs in the graph (GPU path review N4). Called with interval anchors on."""
    if not on_cuda or graph_config is None or family is None:
        return
    backend = getattr(graph_config.prefill.backend, "value", graph_config.prefill.backend)
    if backend in family.anchor_capturing_prefill_graphs:
        raise UnsupportedConfigError(
            f"--cuda-graph-backend-prefill {backend} captures the {family.name} extend, where Tail-Replay's interval "
            f"anchors are written (resolved: prefill {backend}); use {family.eager_prefill_flag}, "
            f"or --tail-replay-anchor-interval 0")


def check_resolved(server_args) -> None:
    problems = unsupported(server_args)
    if problems:
        raise UnsupportedConfigError("--enable-tail-replay does not support SGLang's resolved configuration: "
                                     + "; ".join(problems))
