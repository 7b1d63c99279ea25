"""The replay's collectives under attention data parallelism (`--tp N --dp M --enable-dp-attention`).

Each attention-DP group has its own scheduler, pools and radix tree, so its hits are its own and its replay rows too.
The mixers of a replay are local to the group (their output projections reduce over the attention-TP group,
`families.base.tp_reduced`), but the feed-forward blocks between a group's recurrent layers are sharded over every
TP rank: no group can finish them alone. So every replay pass is one collective pass of all ranks, as SGLang's own
forward is:

1. `exchange_rows`, at the replay point of every forward of a step in which any rank extends (ranks with nothing to
   do run SGLang's IDLE batch then, and no rank runs the decode graph, which skips the hook: SGLang takes the
   decode graph only where every rank can, `dp_attn.py: can_run_decode_cuda_graph` is a minimum over ranks): the
   replay tokens of every rank, all-gathered over the TP group's CPU side;
2. at each feed-forward block, `RowExchange.feed_forward`: every rank's rows gathered into one buffer (by an
   all-reduce of zero-padded slices, as SGLang's `_dp_gather_via_all_reduce`), the block run on all of them, its TP
   sum completed, and the rank's own rows kept. A rank with no replay of its own walks the same blocks in the same
   order with zero rows (`Family.participate`), so the collectives pair up.

Only attention-TP rank 0 of a group contributes its group's rows: its peers hold the same ones.

A step in which no rank replays skips the exchange altogether: SGLang already gathers one row of figures per rank
at every step (`dp_attn.MLPSyncBatchInfo`), and a rank with a replay pending marks its `is_extend_in_batch` entry
(`mark_replay_in_sync_row`), which SGLang reduces to a bool by a max, so that the same gathered row tells every rank
whether any rank replays (`note_replay_in_step`). The decision is made from one tensor every rank holds alike, so the
ranks still exchange together or not at all (review E: the exchange's gloo all-gather took 0.59 ms of every extend
forward on this 2-core CPU).
"""

from dataclasses import dataclass

import torch


def enabled() -> bool:
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled

    return is_dp_attention_enabled()


# SGLang's per-rank MLP-sync row: column 3 is `is_extend_in_batch` (0 or 1), reduced over ranks by a max into a
# bool; a rank with a replay pending adds REPLAY_MARK to it
EXTEND_COLUMN, REPLAY_MARK = 3, 2


def must_exchange(forward_batch, replay_in_step: bool = True) -> bool:
    """Whether this forward is one at which every rank exchanges its replay rows: attention DP on, some rank
    extends in this step (only an extend batch replays) and some rank has a replay pending; both flags are the same
    on every rank."""
    return enabled() and bool(getattr(forward_batch, "is_extend_in_batch", False)) and replay_in_step


def mark_replay_in_sync_row(runtime, row: torch.Tensor, info, *args, **kwargs) -> torch.Tensor:
    """AFTER `MLPSyncBatchInfo._get_local_tensor`: an extending rank with a replay pending marks its row."""
    if len(runtime.pending) and info.is_extend_in_batch:
        row[EXTEND_COLUMN] += REPLAY_MARK
    return row


def note_replay_in_step(runtime, result, info, *args, **kwargs):
    """AFTER `MLPSyncBatchInfo.all_gather`: whether any rank's row carries the mark (every rank reads the same
    gathered rows); where SGLang kept none, the exchange runs as if one did."""
    gathered = info.tp0_info_cpu
    runtime.replay_in_step = gathered is None or int(gathered[:, EXTEND_COLUMN].max()) >= REPLAY_MARK
    return result


@dataclass(frozen=True)
class RowExchange:
    counts: list[int]  # replay rows each TP rank contributes, by TP rank (0 on attention-TP ranks other than 0)
    own: slice  # this rank's group's rows in the gathered buffer

    @property
    def total(self) -> int:
        return sum(self.counts)

    def feed_forward(self, block, h: torch.Tensor, hidden_size: int, dtype, device, reduce) -> torch.Tensor:
        """`block` over every rank's rows, this rank's rows of the result. `h`: this rank's rows (normed), or None
        for a rank that only takes part; `reduce(partial)` completes the block's TP sum."""
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        gathered = torch.zeros(self.total, hidden_size, dtype=dtype, device=device)
        if h is not None and parallel.attn_tp_rank == 0:
            gathered[self.own] = h
        gathered = parallel.tp_group.all_reduce(gathered)
        return reduce(block(gathered))[self.own]


def exchange_rows(local_rows: int) -> RowExchange:
    """Every TP rank's replay rows this step (a CPU all-gather on the TP group: no device sync)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    group = parallel.tp_group
    mine = local_rows if parallel.attn_tp_rank == 0 else 0
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(group.world_size)]
    torch.distributed.all_gather(counts, torch.tensor([mine], dtype=torch.int64), group=group.cpu_group)
    counts = [int(c) for c in counts]
    leader = group.rank_in_group - parallel.attn_tp_rank  # the group's attention-TP rank 0, whose rows count
    start = sum(counts[:leader])
    return RowExchange(counts, slice(start, start + counts[leader]))
