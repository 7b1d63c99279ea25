"""What the Tail-Replay hooks of one scheduler process share: the config, the hidden store, the pending replays and
the metrics. One place, imported by every hook module (`integration`, `pool_report`), so none imports another."""

from tailreplay_sglang.anchors import IntervalAnchors
from tailreplay_sglang.config import TailReplayConfig
from tailreplay_sglang.hidden_store import HiddenStore
from tailreplay_sglang.pending import PendingReplays
from tailreplay_sglang.visibility import ReplayMetrics


class RuntimeState:
    config = TailReplayConfig()  # set by integration.register
    store: HiddenStore | None = None  # created with the KV pool (integration.create_store)
    pending = PendingReplays()
    metrics: ReplayMetrics | None = None  # only with --enable-metrics
    interval_anchors: IntervalAnchors | None = None  # anchors every N prefill tokens, where the ops can take them
    fault_replay_delay_s = 0.0  # reliability tests only (integration.FAULT_REPLAY_DELAY_ENV)
    evicted_anchors = 0  # recurrent states the tree's mamba LRU has dropped since start-up

    @classmethod
    def count_evicted_anchor(cls) -> None:
        cls.evicted_anchors += 1
        if cls.metrics is not None:
            cls.metrics.evicted_anchors.inc()
