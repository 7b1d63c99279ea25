"""The Tail-Replay runtime of one scheduler process: everything the hooks share, in one object.

`plugin.register` creates exactly one `TailReplayRuntime` in each scheduler process (where SGLang loads plugins with
our config in the environment) and `hooks.register_runtime` binds it into every hook that needs it, so each hook
reads its state from the object it was given: nothing is kept in class attributes or module globals.

What it holds, and who fills it:
- `config`: the validated flags (`config.TailReplayConfig`), fixed at creation;
- `pending`: hits between their match and their replay (`cache.pending`), written by the cache component and the
  `prepare_for_extend` hook, taken by the replay hook;
- `staged_anchors`: the anchors hits were matched to, held until their state is copied in the forward
  (`cache.anchor_copy`), written by the cache component, released by the `get_new_batch_prefill` hook;
- `interval_anchors`: the anchor planner, whose plan the prefill hooks fill (None without interval anchors);
- `store`: the hidden store, created with the KV pool (`lifecycle.create_store`);
- `family`: the model's recurrent family (`families/`), bound to the loaded model with the store;
- `host_anchors`: the host pool of evicted anchors (`cache.host_anchors`), created with the store, or None;
- `forward_stream`: the stream the model's forwards run on (CUDA), recorded by every forward, where host-anchor
  saves made while scheduling are ordered;
- `metrics`: Prometheus counters, only with `--enable-metrics`;
- `evicted_anchors` / `evicted_tokens` / `hicache_anchor_*` / `decode_reused_tokens`: counters the pool report
  serves in `/server_info`.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tailreplay_sglang.cache.anchor_copy import StagedAnchors
from tailreplay_sglang.cache.anchors import IntervalAnchors
from tailreplay_sglang.cache.request import PendingReplays
from tailreplay_sglang.config import TailReplayConfig

if TYPE_CHECKING:
    from tailreplay_sglang.cache.host_anchors import HostAnchors
    from tailreplay_sglang.families import Family
    from tailreplay_sglang.store.hidden_store import HiddenStore
    from tailreplay_sglang.visibility import ReplayMetrics


@dataclass(eq=False)
class TailReplayRuntime:
    config: TailReplayConfig
    pending: PendingReplays = field(default_factory=PendingReplays)
    staged_anchors: StagedAnchors = field(default_factory=StagedAnchors)
    interval_anchors: IntervalAnchors | None = None
    store: "HiddenStore | None" = None
    kv_pool: object = None  # the target model's KV pool, whose slots the store shares (a draft model has its own)
    family: "Family | None" = None
    host_anchors: "HostAnchors | None" = None
    forward_stream: object = None
    metrics: "ReplayMetrics | None" = None
    evicted_anchors: int = 0  # recurrent states the tree's mamba LRU has dropped since start-up
    evicted_tokens: int = 0  # tokens the radix tree has evicted since start-up
    hicache_anchor_backups: int = 0  # anchors copied to HiCache's host mamba pool by the plugin (`component.py`)
    hicache_anchor_hits: int = 0  # hits that started from a state in HiCache's host mamba pool
    decode_reused_tokens: int = 0  # PD decode server: KV tokens its radix cache matched (not sent by the prefill)
    # Under attention DP: whether any rank replays in this scheduling step, from SGLang's MLP-sync gather
    # (`dp_attention.note_replay_in_step`); True until a gather says otherwise
    replay_in_step: bool = True

    @classmethod
    def for_scheduler(cls, config: TailReplayConfig) -> "TailReplayRuntime":
        """The runtime of a scheduler process; interval anchors unless the budget or the interval is 0, or the
        process is a PD decode server's (which never prefills)."""
        planned = config.interval_anchors and not config.decode_only
        planner = IntervalAnchors(config.anchor_interval) if planned else None
        return cls(config, interval_anchors=planner)

    def count_evicted_anchor(self) -> None:
        self.evicted_anchors += 1
        if self.metrics is not None:
            self.metrics.evicted_anchors.inc()

    def count_host_anchor_hit(self) -> None:
        """A hit started from a host state (the host pool counts them too, as `restored`)."""
        if self.metrics is not None:
            self.metrics.host_anchor_hits.inc()

    def count_hicache_anchor_backup(self) -> None:
        self.hicache_anchor_backups += 1

    def count_hicache_anchor_hit(self) -> None:
        self.hicache_anchor_hits += 1
        self.count_host_anchor_hit()

    def count_decode_reuse(self, tokens: int) -> None:
        self.decode_reused_tokens += tokens

    def count_evicted_tokens(self, tokens: int) -> None:
        self.evicted_tokens += tokens
