"""SGLang plugin entry point (`sglang.srt.plugins`: `tailreplay`): the Tail-Replay server flags.

`python -m sglang.launch_server` loads plugins before it parses argv, so the hooks below add our flags to SGLang's
own parser and turn them into a validated `TailReplayConfig` when SGLang builds its `ServerArgs`. Without
`--enable-tail-replay` nothing else changes: the server is stock SGLang.
"""

import argparse
import dataclasses
import logging
import sys

from tailreplay_sglang.config import (ANCHOR_KEEP, H2D_MODES, HIDDEN_DTYPES, HIDDEN_TIERS, REPLAY_MODES, STORE_TP,
                                      TailReplayConfig, TailReplayConfigError)
from tailreplay_sglang.layout import HybridLayout

logger = logging.getLogger(__name__)

_OPTION_DESTS = ("tail_replay_ratio", "tail_replay_min_tokens", "tail_replay_max_tokens",
                 "tail_replay_hidden_dtype", "tail_replay_mode", "tail_replay_hidden_tier", "tail_replay_h2d",
                 "tail_replay_anchor_interval", "tail_replay_exact_budget",
                 "tail_replay_host_anchors", "tail_replay_fold_tokens", "tail_replay_anchor_keep",
                 "tail_replay_store_tp")
# The same flags as keywords of sglang.Engine / sgl.Runtime (python_api.py)
KEYWORDS = ("enable_tail_replay", *_OPTION_DESTS)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Tail-Replay (tailreplay-sglang)")
    group.add_argument("--enable-tail-replay", action="store_true",
                       help="token-level prefix reuse for hybrid GDN models: cache FA KV and group input hiddens, "
                            "rebuild GDN states on a hit by replaying a tail of the matched prefix")
    group.add_argument("--tail-replay-ratio", type=float, default=None,
                       help="fraction r of a matched prefix to replay, in (0, 1] (default 0.05)")
    group.add_argument("--tail-replay-min-tokens", type=int, default=None, help="replay at least N tokens (default 64)")
    group.add_argument("--tail-replay-max-tokens", type=int, default=None, help="replay at most N tokens (no cap)")
    group.add_argument("--tail-replay-hidden-dtype", choices=HIDDEN_DTYPES, default=None,
                       help="dtype of the stored group hiddens (default auto: the model's activation dtype, so a "
                            "replay reproduces the forward exactly)")
    group.add_argument("--tail-replay-mode", choices=REPLAY_MODES, default=None,
                       help="ratio (default); full: replay the whole prefix (exact); zero: reuse FA KV with zero "
                            "GDN states (the paper's baseline)")
    group.add_argument("--tail-replay-hidden-tier", choices=HIDDEN_TIERS, default=None,
                       help="where the stored hiddens live: device (next to the KV pool) or host (pinned host memory, "
                            "no device memory; a hit loads only its tail). Default: host on a GPU, device on a CPU")
    group.add_argument("--tail-replay-h2d", choices=H2D_MODES, default=None,
                       help="host tier: load a hit's tail before the replay (ser) or overlapped with it on a copy "
                            "stream (ovl, default)")
    group.add_argument("--tail-replay-anchor-interval", type=int, default=None,
                       help="keep a recurrent state (anchor) every N tokens of a prefill, N a multiple of 64; 0: only "
                            "where requests and prefill chunks end (default 512)")
    group.add_argument("--tail-replay-exact-budget", type=int, default=None,
                       help="replay at most B tokens from the deepest anchor of a hit (exact); past it, the zero-init "
                            "tail. 0: no anchors at all (the paper's mode). Default: max(tail length, anchor interval)")
    group.add_argument("--tail-replay-fold-tokens", type=int, default=None,
                       help="an exact hit at most N tokens past its anchor is matched only up to the anchor, and "
                            "the extend computes those tokens instead of a replay pass (default 64; 0: always replay)")
    group.add_argument("--tail-replay-anchor-keep", choices=ANCHOR_KEEP, default=None,
                       help="which anchor the device mamba pool evicts first: the least recently used one that is "
                            "neither a branch point nor a path's end (ends, default), or the least recently used (lru)")
    group.add_argument("--tail-replay-store-tp", choices=STORE_TP, default=None,
                       help="under attention TP, each rank keeps 1/N of every stored hidden row (shard, default: "
                            "one all-gather per group at a replay) or whole rows (replicate: N times the memory)")
    group.add_argument("--tail-replay-host-anchors", type=int, default=None,
                       help="keep up to N anchors the device mamba pool evicts in host memory (pinned on CUDA); a hit "
                            "whose nearest anchor is there copies it back and replays exactly from it (default 0: off)")


def config_from_args(args: argparse.Namespace) -> TailReplayConfig:
    """Validate our flags against each other and against the rest of the server's flags."""
    given = {d: getattr(args, d) for d in _OPTION_DESTS if getattr(args, d, None) is not None}
    enabled = getattr(args, "enable_tail_replay", None) or False
    if not isinstance(enabled, bool):  # the Python keyword; argparse's store_true is always a bool
        raise TailReplayConfigError(f"--enable-tail-replay must be True or False, got {enabled!r}")
    if not enabled:
        if given:
            flag = "--" + next(iter(given)).replace("_", "-")
            raise TailReplayConfigError(f"{flag} requires --enable-tail-replay")
        return TailReplayConfig()
    mode = getattr(args, "disaggregation_mode", None) or "null"
    if mode == "decode" and given:
        flag = "--" + next(iter(given)).replace("_", "-")
        raise TailReplayConfigError(f"{flag} has no effect on a PD decode server (--disaggregation-mode decode): it "
                                    f"never replays, the prefill server does; give it to the prefill server")
    cfg = TailReplayConfig(enabled=True, disaggregation_mode=mode,
                           **{d.removeprefix("tail_replay_"): v for d, v in given.items()})
    _check_version()
    _check_combination(args)
    if cfg.decode_only:  # no store, no anchors: nothing below applies
        return cfg
    if mode == "prefill" and cfg.host_anchors:
        raise TailReplayConfigError("--tail-replay-host-anchors is not tested on a PD prefill server "
                                    "(--disaggregation-mode prefill) yet: drop it there")
    cfg = dataclasses.replace(cfg, hidden_tier=_hidden_tier(cfg, args))
    try:
        layout = HybridLayout.from_model_path(args.model_path).require_hybrid(args.model_path)
    except ValueError as e:
        raise TailReplayConfigError(str(e)) from None
    return _for_mixer(cfg, layout, getattr(args, "linear_attn_prefill_backend", None))


def _for_mixer(cfg: TailReplayConfig, layout: HybridLayout, prefill_backend: str | None = None) -> TailReplayConfig:
    """Interval anchors are taken on the grid of the family's chunked prefill (`Family.anchor_grid`): the interval
    must be a multiple of it, or no anchor would fall on the grid; and their states are read from that prefill's
    kernel, so a linear-attention prefill backend that returns none is refused. A family whose state is a window of
    its last inputs (`Family.state_window`) takes none: every hit replays the window from a cleared slot, exact."""
    from tailreplay_sglang.families import family_for

    family = family_for(layout)
    window = family.state_window(layout)
    if window is not None:
        logger.info("Tail-Replay: this %s model's state is its last %d inputs: every hit replays them from a cleared "
                    "slot, exactly, and no anchor is kept (the anchor and budget flags do not apply)", family.name,
                    window)
        return dataclasses.replace(cfg, exact_budget=0, host_anchors=0, state_window=window)
    if not cfg.interval_anchors:
        return cfg
    grid = family.anchor_grid(layout)
    if cfg.anchor_interval % grid:
        raise TailReplayConfigError(f"--tail-replay-anchor-interval {cfg.anchor_interval}: this model's chunked "
                                    f"prefill works in chunks of {grid} tokens and anchors are taken on that grid: "
                                    f"use a multiple of {grid}")
    readable = family.anchor_prefill_backends
    if readable is not None and prefill_backend not in (None, *readable):
        raise TailReplayConfigError(
            f"--linear-attn-prefill-backend {prefill_backend}: Tail-Replay reads this {family.name} model's interval "
            f"anchors from the per-chunk states of the {' or '.join(readable)} prefill, which {prefill_backend} does "
            f"not return. Drop the flag ({ANCHOR_PREFILL_BACKEND} is then selected) or turn interval anchors off "
            f"with --tail-replay-anchor-interval 0")
    return cfg


def _check_version() -> None:
    import sglang

    from tailreplay_sglang.supported import check_version

    check_version(getattr(sglang, "__version__", "unknown"))


def _check_combination(args: argparse.Namespace) -> None:
    refused = {
        "disable_radix_cache": "--disable-radix-cache",
    }
    for dest, flag in refused.items():
        if getattr(args, dest, None):
            raise TailReplayConfigError(f"--enable-tail-replay does not support {flag} yet")
    from tailreplay_sglang.cache.component import RADIX_CACHE_BACKEND  # SGLang's cache modules: only when enabled

    backend = getattr(args, "radix_cache_backend", None)
    if backend not in (None, RADIX_CACHE_BACKEND):
        raise TailReplayConfigError(f"--enable-tail-replay selects its own radix cache; drop --radix-cache-backend "
                                    f"{backend}")
    # --tp-size and --dp-size work (docs/scale-out.md); a pipeline stage would hold only some groups' layers
    if (getattr(args, "pp_size", None) or 1) > 1:
        raise TailReplayConfigError("--enable-tail-replay supports --pp-size 1 only for now")


def _hidden_tier(cfg: TailReplayConfig, args: argparse.Namespace) -> str:
    """The tier, chosen for the device where not given: on a GPU the host tier, which costs the device no memory
    (under CUDA graphs through its staging area, `store/staging.py`); on a CPU host and device are one memory."""
    if cfg.hidden_tier is not None:
        return cfg.hidden_tier
    device = getattr(args, "device", None) or ("cuda" if _cuda_available() else "cpu")
    return "host" if device == "cuda" else "device"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def after_add_cli_args(result, parser, *args, **kwargs):
    add_cli_args(parser)
    return result


def around_from_cli_args(original, cls, args, *rest, **kwargs):
    try:
        cfg = config_from_args(args)
    except TailReplayConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for name, value in hand_off(cfg, args).items():
        setattr(args, name, value)
    return original(cls, args, *rest, **kwargs)


# The linear-attention prefill whose per-chunk states the GDN and KDA interval anchors are read from. Left unset,
# SGLang picks FlashInfer's GDN prefill on SM90/SM100 (gdn_backend.flashinfer_gdn_prefill_default) and its KDA
# prefill on SM100 (kda_backend.flashinfer_kda_prefill_default); neither returns those states.
ANCHOR_PREFILL_BACKEND = "triton"


def hand_off(cfg: TailReplayConfig, args) -> dict:
    """Give a validated config to the scheduler processes (spawned with this environment; written also when
    disabled, so a stock server after a Tail-Replay one in the same process stays stock). Returns the ServerArgs
    fields SGLang must be given ({} when Tail-Replay is off): our radix cache backend and, with interval anchors, the
    prefill backend they are read from where the user chose none (a chosen one was checked by `_for_mixer`)."""
    cfg.to_env()
    if not cfg.enabled:
        return {}
    from tailreplay_sglang.cache.component import RADIX_CACHE_BACKEND  # SGLang's cache modules: only when enabled

    logger.info("Tail-Replay enabled: %s", cfg)
    fields = {"radix_cache_backend": RADIX_CACHE_BACKEND}
    if cfg.interval_anchors and not cfg.decode_only and getattr(args, "linear_attn_prefill_backend", None) is None:
        fields["linear_attn_prefill_backend"] = ANCHOR_PREFILL_BACKEND
        logger.info("Tail-Replay: --linear-attn-prefill-backend %s (interval anchors are read from its per-chunk "
                    "states; SGLang's FlashInfer GDN/KDA prefill on SM90/SM100 returns none)", ANCHOR_PREFILL_BACKEND)
    if getattr(args, "enable_hierarchical_cache", False) and getattr(args, "hicache_storage_backend", None) in \
            ("mooncake", "file"):
        from tailreplay_sglang.cache.storage_key import storage_tag, with_storage_tag

        tag = storage_tag(args, cfg.hidden_dtype)
        fields["hicache_storage_backend_extra_config"] = with_storage_tag(
            getattr(args, "hicache_storage_backend_extra_config", None), tag)
        logger.info("Tail-Replay: L3 pages tagged %s (the checkpoint and the dtypes they hold)", tag)
    return fields


def register() -> None:
    """Entry point `tailreplay`, run by SGLang's `load_plugins` in the launcher and in every spawned process. The
    hooks themselves are listed in `hooks.py`."""
    from tailreplay_sglang import hooks

    hooks.register_always()  # the flags, request validation, meta_info, OLMo-Hybrid
    if not _spawned():
        # A launcher (or an Engine's own process) reads its config from its flags or keywords, never from an
        # environment an earlier launch left behind; it hands its own config to the processes it spawns.
        return
    config = TailReplayConfig.from_env()
    if config.enabled:  # in SGLang's scheduler process, spawned after the launcher validated the flags
        from tailreplay_sglang.runtime import TailReplayRuntime

        hooks.register_runtime(TailReplayRuntime.for_scheduler(config))


def _spawned() -> bool:
    """Whether this process was started by SGLang through multiprocessing (schedulers, TP/DP ranks, detokenizer)."""
    import multiprocessing

    return multiprocessing.parent_process() is not None
