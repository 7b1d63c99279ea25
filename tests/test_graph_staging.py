"""Issue 63 item 2: the host hidden tier under CUDA graphs, by construction on a CPU.

A captured forward's capture points write their rows into the store's device staging area (`store/staging.py`);
after each replay the graph runner's hook flushes them to the write-back, in forward order. Under the graph stand-in
(`graph_stand_in.py`: only the ops the capture launched run at replay, on the memory they ran on; no host reads, no
writes outside the graph's buffers), the host tables must end up holding, slot for slot, what an eager device-tier
store holds after the same forwards: no row lost, none stale, a reused slot with its newest value."""

import random
from types import SimpleNamespace

import pytest
import torch

from graph_stand_in import GraphCaptureError, GraphStandIn
from tailreplay_sglang.capture import write_rows
from tailreplay_sglang.layout import FULL, LINEAR, HybridLayout
from tailreplay_sglang.store.hidden_store import HiddenStore
from tailreplay_sglang.store.staging import EMPTY

LAYOUT = HybridLayout(tuple(LINEAR if c == "G" else FULL for c in "GGGA" * 3), hidden_size=16)  # groups at 4, 8
SLOTS, BS = 24, 4  # the store's slots (0: SGLang's padding slot), a decode graph's batch size


class Graphed:
    """A host-tier store whose capture points run inside one captured decode graph of batch size BS: the graph's
    static inputs (out_cache_loc, input_ids, each stored group's input) are filled before each replay, as SGLang's
    runner copies a batch into them, and the runner's hook flushes after it."""

    def __init__(self, dtype=torch.float32, staging_rows=BS, capture=True):
        self.loc = torch.zeros(BS, dtype=torch.int64)
        self.ids = torch.zeros(BS, dtype=torch.int64)
        self.values = {g.first_layer: torch.zeros(BS, LAYOUT.hidden_size) for g in LAYOUT.stored_groups}
        self.graph = None
        self.store = HiddenStore(LAYOUT, SLOTS, dtype, "cpu", "host", staging_rows=staging_rows,
                                 capturing=lambda: self.graph is not None and self.graph.capturing)
        staging = self.store.staging
        self.graph = GraphStandIn([self.loc, self.ids, *self.values.values(),
                                   *(() if staging is None else (*staging.slots, *staging.rows))])
        if capture:
            self.graph.capture(self._forward)

    def _forward(self) -> None:
        batch = SimpleNamespace(out_cache_loc=self.loc, input_ids=self.ids)
        write_rows(self.store, None, batch, None)
        for layer, values in self.values.items():
            write_rows(self.store, layer, batch, values)

    def replay(self, slots, ids, values) -> None:
        """A decode step through the graph: `len(slots)` real requests, the rest padding (slot 0)."""
        n = len(slots)
        self.loc.zero_()
        self.loc[:n] = slots
        self.ids[:n] = ids
        for layer in self.values:
            self.values[layer][:n] = values[layer]
        self.graph.replay()
        self.store.flush_staging(n)

    def eager(self, slots, ids, values, flush: bool = False) -> None:
        """An extend that runs eagerly (no graph); `flush`: a graph replay whose capture points ran eagerly (the
        breakable prefill graph), after which the runner's hook flushes all the same."""
        batch = SimpleNamespace(out_cache_loc=slots, input_ids=ids)
        write_rows(self.store, None, batch, None)
        for layer, v in values.items():
            write_rows(self.store, layer, batch, v)
        if flush:
            self.store.flush_staging(len(slots))


def _reference(steps) -> HiddenStore:
    ref = HiddenStore(LAYOUT, SLOTS, torch.float32, "cpu")  # the device tier, eager: rows written in place
    for _, slots, ids, values in steps:
        ref.write_tokens(slots, ids)
        for layer, v in values.items():
            ref.write_hidden(layer, slots, v)
    return ref


def _steps(seed: int, count: int):
    """Random forwards over few slots, so slots are freed and reused often: graph decode steps of 1..BS requests
    and eager extends of 1..8 tokens (some of them through a graph whose capture points ran eagerly)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        kind = rng.choice(("graph", "graph", "eager", "eager-in-graph"))
        n = rng.randint(1, BS if kind == "graph" else 8)
        slots = torch.tensor(rng.sample(range(1, SLOTS), n))
        ids = torch.randint(0, 1000, (n,), generator=g)
        values = {grp.first_layer: torch.randn(n, LAYOUT.hidden_size, generator=g) for grp in LAYOUT.stored_groups}
        yield kind, slots, ids, values


def _assert_same_rows(store: HiddenStore, ref: HiddenStore, where: str) -> None:
    store.drain()
    assert torch.equal(store.token_ids, ref.token_ids), where
    assert torch.equal(store.hiddens, ref.hiddens), where


def test_the_capture_writes_only_the_staging_area_and_no_host_table():
    graphed = Graphed()
    assert graphed.graph._ops, "the capture launched nothing"
    assert not graphed.store.token_ids.any() and not graphed.store.hiddens.any()  # nothing reached the host
    assert len(graphed.store.write_back) == 0


def test_the_stand_in_refuses_the_eager_write_back_inside_a_capture():
    """Without a staging area the host tier's write-back would run at capture (here: its host-side apply into the
    host table) and never again: the stand-in refuses it, as a CUDA graph cannot hold it."""
    with pytest.raises(GraphCaptureError, match="not the graph's"):
        Graphed(staging_rows=0)


@pytest.mark.parametrize("seed", range(4))
def test_no_row_is_lost_or_stale_across_many_graph_and_eager_steps(seed):
    graphed, steps = Graphed(), list(_steps(seed, 60))
    for i, (kind, slots, ids, values) in enumerate(steps):
        if kind == "graph":
            graphed.replay(slots, ids, values)
        else:
            graphed.eager(slots, ids, values, flush=kind == "eager-in-graph")
        if i % 7 == 0 or i == len(steps) - 1:  # a hit's read (drain) between forwards
            _assert_same_rows(graphed.store, _reference(steps[:i + 1]), f"after step {i} ({kind})")


def test_a_reused_slot_ends_with_its_newest_value():
    """Slot 5 written by a graph step, then by an eager extend (the slot freed and reused), then a replay that
    staged nothing is flushed: the eager row must stay. Then two graph steps in a row: the second one's row."""
    graphed = Graphed()
    row = {g.first_layer: torch.full((1, LAYOUT.hidden_size), 0.0) for g in LAYOUT.stored_groups}

    def rows(value):
        return {layer: r + value for layer, r in row.items()}

    slot = torch.tensor([5])
    graphed.replay(slot, torch.tensor([11]), rows(1.0))
    graphed.eager(slot, torch.tensor([22]), rows(2.0))
    graphed.eager(torch.tensor([7]), torch.tensor([33]), rows(3.0), flush=True)
    graphed.store.drain()
    assert graphed.store.token_ids[5] == 22 and graphed.store.hiddens[:, 5].eq(2.0).all()
    graphed.replay(slot, torch.tensor([44]), rows(4.0))
    graphed.replay(slot, torch.tensor([55]), rows(5.0))
    graphed.store.drain()
    assert graphed.store.token_ids[5] == 55 and graphed.store.hiddens[:, 5].eq(5.0).all()
    assert graphed.store.staging.slots[0].eq(EMPTY).all()  # flushed: nothing left to apply twice


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_encoded_rows_are_staged_as_the_eager_path_writes_them(dtype):
    """The codec runs inside the graph (float8: its scale per row too): staged rows equal the eager ones."""
    graphed, eager = Graphed(dtype), HiddenStore(LAYOUT, SLOTS, dtype, "cpu", "host")
    for kind, slots, ids, values in _steps(9, 20):
        if kind == "graph":
            graphed.replay(slots, ids, values)
        else:
            graphed.eager(slots, ids, values)
        eager.write_tokens(slots, ids)
        for layer, v in values.items():
            eager.write_hidden(layer, slots, v)
    _assert_same_rows(graphed.store, eager, "end")


def test_a_graph_of_more_rows_than_the_staging_area_fails_its_capture():
    with pytest.raises(RuntimeError, match="stages 2 rows per CUDA graph replay, and this graph captures 4"):
        Graphed(staging_rows=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA graph needs a CUDA GPU (scripts/gpu_check.sh)")
def test_a_real_cuda_graph_of_the_capture_points_lands_every_row_on_the_host():
    """The same contract under `torch.cuda.graph`: a host-tier store with its staging area, the capture points
    captured once, replayed with new batches (flushed after each, as the runner's hook does) between eager writes."""
    device = torch.device("cuda")
    loc = torch.zeros(BS, dtype=torch.int64, device=device)
    ids = torch.zeros(BS, dtype=torch.int64, device=device)
    values = {g.first_layer: torch.zeros(BS, LAYOUT.hidden_size, device=device) for g in LAYOUT.stored_groups}
    store = HiddenStore(LAYOUT, SLOTS, torch.bfloat16, device, "host", staging_rows=BS)
    batch = SimpleNamespace(out_cache_loc=loc, input_ids=ids)

    def forward():
        write_rows(store, None, batch, None)
        for layer, v in values.items():
            write_rows(store, layer, batch, v)

    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    for staged in store.staging.slots:  # the capture ran the copies once, with the zero batch
        staged.fill_(EMPTY)
    ref = HiddenStore(LAYOUT, SLOTS, torch.bfloat16, device)
    for kind, slots, step_ids, step_values in _steps(5, 40):
        slots, step_ids = slots.to(device), step_ids.to(device)
        step_values = {k: v.to(device) for k, v in step_values.items()}
        if kind == "graph":
            n = len(slots)
            loc.zero_()
            loc[:n], ids[:n] = slots, step_ids
            for layer in values:
                values[layer][:n] = step_values[layer]
            graph.replay()
            store.flush_staging(n)
        else:
            eager = SimpleNamespace(out_cache_loc=slots, input_ids=step_ids)
            write_rows(store, None, eager, None)
            for layer, v in step_values.items():
                write_rows(store, layer, eager, v)
        ref.write_tokens(slots, step_ids)
        for layer, v in step_values.items():
            ref.write_hidden(layer, slots, v)
    store.drain()
    assert torch.equal(store.token_ids[1:], ref.token_ids[1:].cpu())  # slot 0: the graph's padding rows
    assert torch.equal(store.hiddens[:, 1:], ref.hiddens[:, 1:].cpu())


def test_the_graph_runners_hook_flushes_after_each_replay_and_never_for_a_draft_model():
    """`lifecycle.flush_after_graph` (AROUND the decode and prefill graph runners' `execute`): the replay's staged
    rows reach the host once the graph has run, for the batch's new tokens; a draft model's runner (EAGLE, MTP)
    captured none of the target's rows, so its replays flush nothing."""
    from tailreplay_sglang.lifecycle import flush_after_graph

    graphed = Graphed()
    runtime = SimpleNamespace(store=graphed.store)
    slots, ids = torch.tensor([3, 9]), torch.tensor([41, 42])
    values = {g.first_layer: torch.full((2, LAYOUT.hidden_size), 1.5) for g in LAYOUT.stored_groups}

    def execute(runner, forward_batch):  # SGLang's runner: load the batch into the graph's inputs, replay
        graphed.loc.zero_()
        graphed.loc[:2], graphed.ids[:2] = slots, ids
        for layer in graphed.values:
            graphed.values[layer][:2] = values[layer]
        graphed.graph.replay()
        return "logits"

    draft = SimpleNamespace(model_runner=SimpleNamespace(is_draft_worker=True))
    assert flush_after_graph(runtime, execute, draft, SimpleNamespace(out_cache_loc=slots)) == "logits"
    assert not graphed.store.token_ids.any()  # staged, not flushed
    target = SimpleNamespace(model_runner=SimpleNamespace(is_draft_worker=False))
    assert flush_after_graph(runtime, execute, target, SimpleNamespace(out_cache_loc=slots)) == "logits"
    graphed.store.drain()
    assert graphed.store.token_ids[[3, 9]].tolist() == [41, 42] and graphed.store.hiddens[:, [3, 9]].eq(1.5).all()
