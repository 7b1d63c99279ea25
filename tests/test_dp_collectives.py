"""The replay's collectives under attention DP (`tailreplay_sglang/dp_attention.py`) without a server: the row exchange
on two gloo processes against one process, and the SGLang facts the design rests on (GPU by construction), pinned on
SGLang 0.5.23's source. The servers that run it: tests/test_dp_attention.py."""

import inspect
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tailreplay_eval.server import free_port

HIDDEN, INNER = 8, 12


def _sharded_mlp(rank: int, world: int):
    """A dense MLP as SGLang shards it over TP: up projection column-parallel, down projection row-parallel, its TP
    sum left to the caller (reduce_results=False). Rank r's shard of one seeded full MLP."""
    gen = torch.Generator().manual_seed(0)
    up, down = torch.randn(INNER, HIDDEN, generator=gen), torch.randn(HIDDEN, INNER, generator=gen)
    cols = slice(rank * INNER // world, (rank + 1) * INNER // world)
    return lambda x: torch.relu(x @ up[cols].T) @ down[:, cols].T, lambda x: torch.relu(x @ up.T) @ down.T


class _Group:
    """What the exchange uses of SGLang's TP GroupCoordinator, over the default gloo group."""

    def __init__(self, rank, world):
        self.rank_in_group, self.world_size, self.cpu_group = rank, world, dist.group.WORLD

    def all_reduce(self, t):
        dist.all_reduce(t)
        return t

    def all_gather(self, t, dim=-1):
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=dim)


ROWS = ([3, 5], [4, 0], [0, 2])  # replay rows per rank, one exchange each: both replay, one only takes part


# Attention TP 2 in a TP group of 4 (--tp 4 --dp 2): ranks 0-1 are attention-DP group 0, ranks 2-3 group 1; the
# peers of a group hold the same batch, so rows are given per group
GROUP_ROWS = ([3, 5], [4, 0], [0, 2])


def _rank_main(rank: int, world: int, port: int, out_dir: str, attn_tp: int = 1) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import sglang.srt.runtime_context as runtime_context

    from tailreplay_sglang import dp_attention

    parallel = SimpleNamespace(attn_tp_rank=rank % attn_tp, tp_group=_Group(rank, world))
    runtime_context.get_parallel = lambda: parallel
    block, _ = _sharded_mlp(rank, world)
    results = []
    group = rank // attn_tp
    for case, rows in enumerate(ROWS if attn_tp == 1 else GROUP_ROWS):
        # attention-TP peers: the same rows (one seed per group)
        h = torch.randn(rows[group], HIDDEN, generator=torch.Generator().manual_seed(10 * case + group))
        exchange = dp_attention.exchange_rows(rows[group])
        reduce = lambda partial: parallel.tp_group.all_reduce(partial)  # noqa: E731
        out = exchange.feed_forward(block, h if rows[group] else None, HIDDEN, torch.float32, "cpu", reduce)
        results.append({"counts": exchange.counts, "h": h, "out": out})
    torch.save(results, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


def test_each_rank_gets_its_own_rows_of_the_block_over_every_ranks_rows(tmp_path):
    """Two ranks, each with its own replay rows (or none: it takes part only), in three exchanges one after the
    other: every rank's rows come back as the whole (unsharded) block computes them, and a rank with none gets
    none."""
    mp.start_processes(_rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    _, full = _sharded_mlp(0, 1)
    for rank in range(2):
        for rows, got in zip(ROWS, torch.load(tmp_path / f"{rank}.pt")):
            assert got["counts"] == rows
            assert got["out"].shape == (rows[rank], HIDDEN)
            torch.testing.assert_close(got["out"], full(got["h"]), rtol=1e-5, atol=1e-5)


def test_attention_tp_peers_each_get_their_groups_rows(tmp_path):
    """Issue 65 class 3: --tp 4 --dp 2 (attention TP 2), as four gloo ranks in two attention-DP groups of two. Only a
    group's attention-TP rank 0 contributes its rows (its peers hold the same batch), the feed-forward block is
    sharded over all four, and every rank of a group gets its group's rows of the whole block's result."""
    mp.start_processes(_rank_main, args=(4, free_port(), str(tmp_path), 2), nprocs=4, start_method="spawn")
    _, full = _sharded_mlp(0, 1)
    for rank in range(4):
        group = rank // 2
        for rows, got in zip(GROUP_ROWS, torch.load(tmp_path / f"{rank}.pt")):
            assert got["counts"] == [rows[0], 0, rows[1], 0]
            assert got["out"].shape == (rows[group], HIDDEN)
            torch.testing.assert_close(got["out"], full(got["h"]), rtol=1e-5, atol=1e-5)


def _store_rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """One attention-TP rank's hidden store, sharded: the same (replicated) values written, a tail read and
    decoded, for each row dtype."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from tailreplay_sglang.layout import FULL, LINEAR, HybridLayout
    from tailreplay_sglang.store.hidden_store import HiddenStore, Shard
    from tailreplay_sglang.store.transfer import HostToDevice

    # 64 columns: a rank's 32 are one int4 scale group
    layout = HybridLayout(tuple(LINEAR if c == "G" else FULL for c in "GGGA" * 3), hidden_size=64)
    values = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(3)) * 4  # the same on every rank
    slots, tail = torch.arange(20, 30), torch.tensor([27, 21, 24])
    results = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int4):
        store = HiddenStore(layout, 64, dtype, "cpu", shard=Shard(rank, world, _Group(rank, world)))
        for row, group in enumerate(layout.stored_groups):
            store.write_hidden(group.first_layer, slots, values[row])
        rows = store.fetch_tail(tail, HostToDevice("cpu"))
        results[str(dtype)] = {"bytes": store.hiddens[0, 0].numel() * store.hiddens.element_size(),
                               "decoded": [store.decode(rows[g.first_layer], torch.float32)
                                           for g in layout.stored_groups]}
    torch.save({"values": values[:, tail - 20], "results": results}, f"{out_dir}/store{rank}.pt")
    dist.destroy_process_group()


def test_a_sharded_store_keeps_half_of_each_row_per_rank_and_a_replay_gets_whole_rows(tmp_path):
    """Issue 63 item 1: at attention TP 2 each rank keeps 1/2 of every stored row (sliced from its replicated value
    at capture), and a tail's decoded rows are whole on every rank after one all-gather per group: equal to what
    was written in float32, within the row dtype's rounding otherwise (float8: a scale per rank's part)."""
    mp.start_processes(_store_rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    from tailreplay_sglang.store.codec import SCALE_SLOT

    got = [torch.load(tmp_path / f"store{rank}.pt") for rank in (0, 1)]
    # half of 64 columns a rank; int4: 16 code bytes + one 2-byte scale, padded to 24; within half its step
    for dtype, part_bytes, rtol, atol in (("torch.float32", 32 * 4, 0, 0), ("torch.bfloat16", 32 * 2, 0.05, 0.05),
                                          ("torch.float8_e4m3fn", 32 + SCALE_SLOT, 0.15, 0.15),
                                          ("torch.int4", 24, 0, 1.2)):
        for rank in (0, 1):
            result = got[rank]["results"][dtype]
            assert result["bytes"] == part_bytes, (dtype, result["bytes"])
            for row, decoded in enumerate(result["decoded"]):
                torch.testing.assert_close(decoded, got[rank]["values"][row], rtol=rtol, atol=atol)


def _source(obj) -> str:
    return inspect.getsource(obj)


def test_no_rank_takes_the_decode_graph_in_a_step_with_an_extend():
    """A replay pass needs every rank at the replay point, which the decode graph skips. SGLang takes the decode
    graph under DP attention only where every rank votes for it (the minimum of the step's all-gathered votes), and
    a rank with an extend batch votes against; the step's extend flag is the maximum, the same on every rank."""
    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    vote = dp_attn._local_decode_cuda_graph_vote
    assert vote(local_batch=SimpleNamespace(forward_mode=ForwardMode.EXTEND), disable_cuda_graph=False) is False
    assert vote(local_batch=SimpleNamespace(forward_mode=ForwardMode.DECODE), disable_cuda_graph=False) is True
    gather = _source(dp_attn.MLPSyncBatchInfo)
    assert "self.can_run_decode_cuda_graph = bool(tp0_info_cpu[:, 2].min())" in gather
    assert "self.is_extend_in_batch = bool(tp0_info_cpu[:, 3].max())" in gather
    assert "forward_batch.can_run_decode_cuda_graph if self.require_mlp_sync else True" in " ".join(
        _source(DecodeCudaGraphRunner).split())


def test_every_eager_forward_passes_the_replay_point():
    """`_forward_raw` returns before the replay point (after SGLang's deferred mamba copy) on the decode graph path
    only: extend, idle and eager decode batches all reach it."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    forward = _source(ModelRunner._forward_raw)
    replay_point = forward.index("self._maybe_execute_deferred_mamba_cow_and_clear(forward_batch)")
    before = forward[:replay_point]
    assert before.count("return ") == 1
    assert before.index("if can_run_graph:") < before.index("return ") < before.index("_prepare_eager_forward_batch")


def test_steps_without_a_replay_anywhere_skip_the_row_exchange():
    """Review E: a rank with a replay pending marks its entry of SGLang's per-step MLP-sync row (column 3,
    `is_extend_in_batch`), SGLang still reduces that column to "some rank extends", and every rank reads from the
    same gathered rows whether any rank replays: the exchange runs in those steps only."""
    from sglang.srt.managers.scheduler_components.dp_attn import MLPSyncBatchInfo

    from tailreplay_sglang import dp_attention

    def row(extending: bool, pending: int):
        info = MLPSyncBatchInfo(num_dp_ranks=2, tp_size=1, cp_size=1, num_tokens=7, num_tokens_for_logprob=7,
                                can_run_decode_cuda_graph=False, can_run_draft_cuda_graph=False,
                                can_run_prefill_cuda_graph=False, is_extend_in_batch=extending,
                                local_can_run_tbo=False, local_forward_mode=1)
        local = info._get_local_tensor(device="cpu")
        assert local[dp_attention.EXTEND_COLUMN] == int(extending)  # the column SGLang reduces by a max
        return dp_attention.mark_replay_in_sync_row(SimpleNamespace(pending=[None] * pending), local, info)

    for rows, extends, replays in (((row(True, 1), row(False, 0)), True, True),
                                   ((row(True, 0), row(True, 0)), True, False),
                                   ((row(False, 3), row(False, 0)), False, False),  # a stale entry, no extend
                                   ((row(False, 0), row(True, 2)), True, True)):
        gathered = torch.stack(rows)
        info = SimpleNamespace(tp0_info_cpu=gathered)
        runtime = SimpleNamespace(replay_in_step=None)
        dp_attention.note_replay_in_step(runtime, None, info)
        assert runtime.replay_in_step is replays and bool(gathered[:, 3].max()) is extends  # as SGLang reads it
    runtime = SimpleNamespace(replay_in_step=None)
    dp_attention.note_replay_in_step(runtime, None, SimpleNamespace(tp0_info_cpu=None))
    assert runtime.replay_in_step is True  # no gathered rows: exchange as before
