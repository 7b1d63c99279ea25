"""The hidden store's two tiers and its transfers, without a server: the host tier (write-back, tail fetch through
`HostToDevice`, serialized or overlapped) must hold and return exactly what the device tier does, and the
write-back must apply copies in submission order whatever order they land in."""

import argparse

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import HOST_READS, count_tensor_calls
from tailreplay_sglang.config import TailReplayConfig
from tailreplay_sglang.store.hidden_store import TOKENS, HiddenStore
from tailreplay_sglang.layout import FULL, LINEAR, HybridLayout
from tailreplay_sglang.plugin import _hidden_tier
from tailreplay_sglang.store.transfer import DeviceToHostWriteBack, HostToDevice

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYOUT = HybridLayout(tuple(LINEAR if c == "G" else FULL for c in "GGGA" * 3), hidden_size=16)  # 2 stored groups
# int4 rows scale groups of 32 values, so its stores need a hidden size of whole groups.
INT4_LAYOUT = HybridLayout(LAYOUT.layer_types, hidden_size=64)
ENCODINGS = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int4]


def _layout_for(dtype: torch.dtype) -> HybridLayout:
    return INT4_LAYOUT if dtype == torch.int4 else LAYOUT


def _forwards(num_slots: int, steps: int, seed: int, hidden_size: int = LAYOUT.hidden_size):
    """Random 'forwards': each writes token ids and both stored groups' hiddens to a batch of slots, with slots
    reused across forwards (a freed KV slot gets a new token), as the capture hooks do."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        n = int(torch.randint(1, num_slots // 2, (1,), generator=g))
        slots = torch.randperm(num_slots - 1, generator=g)[:n] + 1  # slot 0 is SGLang's padding
        tokens = torch.randint(0, 1000, (n,), generator=g)
        hiddens = {layer: torch.randn(n, hidden_size, generator=g) for layer in (4, 8)}
        yield slots.to(DEVICE), tokens.to(DEVICE), {k: v.to(DEVICE) for k, v in hiddens.items()}


def _fill(store: HiddenStore, seed: int) -> None:
    for slots, tokens, hiddens in _forwards(store.token_ids.numel(), steps=12, seed=seed,
                                            hidden_size=store.layout.hidden_size):
        store.write_tokens(slots, tokens)
        for layer, values in hiddens.items():
            store.write_hidden(layer, slots, values)


# Only CUDA overlaps the load ("ovl"); on a CPU both modes run the same code, so one of them is enough.
@pytest.mark.parametrize("h2d_mode", ["ser", "ovl"] if torch.cuda.is_available() else ["ser"])
@pytest.mark.parametrize("dtype", ENCODINGS)
def test_host_tier_returns_exactly_what_the_device_tier_does(h2d_mode, dtype):
    stores = {tier: HiddenStore(_layout_for(dtype), 64, dtype, DEVICE, tier) for tier in ("device", "host")}
    for store in stores.values():
        _fill(store, seed=0)
    assert stores["host"].hiddens.device.type == "cpu" and stores["host"].pending_write_backs() == 0
    tail = torch.tensor([5, 9, 9, 1, 63, 17], device=DEVICE)  # a tail may name any slot, even twice
    got = {}
    for tier, store in stores.items():
        h2d = HostToDevice(DEVICE, h2d_mode)
        loads = store.fetch_tail(tail, h2d)
        h2d.wait_all()
        assert set(loads) == {TOKENS, 4, 8}
        assert all(t.device.type == torch.device(DEVICE).type for t in loads.values())
        got[tier] = {k: v.cpu() for k, v in loads.items()}
    for key in got["device"]:
        assert torch.equal(got["device"][key], got["host"][key]), key


def test_last_write_to_a_slot_wins_on_both_tiers():
    for tier in ("device", "host"):
        store = HiddenStore(LAYOUT, 8, torch.float32, DEVICE, tier)
        slots = torch.tensor([3, 4], device=DEVICE)
        store.write_hidden(4, slots, torch.ones(2, 16, device=DEVICE))
        store.write_hidden(4, slots[:1], torch.full((1, 16), 7.0, device=DEVICE))  # slot 3 freed and reused
        got = store.read_hidden(4, slots).cpu()
        assert got[0].eq(7).all() and got[1].eq(1).all(), tier


def test_move_carries_rows_reading_before_writing_on_both_tiers():
    """A draft tree's accepted tokens move to the front of their block (`HiddenStore.move`): rows 5 -> 2 and 2 -> 3
    swap through, as the KV pool's move does (every source read before any target is written)."""
    for tier in ("device", "host"):
        store = HiddenStore(LAYOUT, 8, torch.float32, DEVICE, tier)
        _fill(store, seed=1)
        slots = torch.arange(8, device=DEVICE)
        before = {key: store.read_hidden(key, slots).cpu() for key in (4, 8)}
        tokens = store.read_tokens(slots).cpu()
        store.move(torch.tensor([2, 3], device=DEVICE), torch.tensor([5, 2], device=DEVICE))
        for key, rows in before.items():
            after = store.read_hidden(key, slots).cpu()
            assert torch.equal(after[2], rows[5]) and torch.equal(after[3], rows[2]) and torch.equal(after[5], rows[5])
        assert store.read_tokens(slots).cpu()[[2, 3]].tolist() == tokens[[5, 2]].tolist(), tier


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(st.sampled_from(["write", "move"]), st.lists(st.integers(1, 11), min_size=1,
                                                                              max_size=6, unique=True),
                                st.lists(st.integers(1, 11), min_size=6, max_size=6), st.integers(0, 1000)),
                      min_size=1, max_size=12))
def test_writes_and_draft_tree_moves_match_a_reference_on_both_tiers(steps):
    """Property: any interleaving of forwards' writes and a draft tree's moves leaves every row what a slot -> row
    dictionary says (a move reads every source before writing any target), on both tiers."""
    stores = {tier: HiddenStore(LAYOUT, 12, torch.float32, DEVICE, tier) for tier in ("device", "host")}
    reference = {slot: (0, torch.zeros(LAYOUT.hidden_size)) for slot in range(12)}
    for kind, slots, sources, seed in steps:
        if kind == "write":
            g = torch.Generator().manual_seed(seed)
            tokens, values = torch.randint(0, 1000, (len(slots),), generator=g), torch.randn(len(slots), 16,
                                                                                              generator=g)
            for store in stores.values():
                store.write_tokens(torch.tensor(slots, device=DEVICE), tokens.to(DEVICE))
                store.write_hidden(4, torch.tensor(slots, device=DEVICE), values.to(DEVICE))
            reference.update({s: (int(t), v) for s, t, v in zip(slots, tokens, values)})
        else:
            source = sources[: len(slots)]
            for store in stores.values():
                store.move(torch.tensor(slots, device=DEVICE), torch.tensor(source, device=DEVICE))
            reference.update({t: reference[s] for t, s in zip(slots, source)})
    everything = torch.arange(12, device=DEVICE)
    for tier, store in stores.items():
        assert store.read_tokens(everything).cpu().tolist() == [reference[s][0] for s in range(12)], tier
        assert torch.equal(store.read_hidden(4, everything).cpu(), torch.stack([reference[s][1] for s in range(12)]))


class _Event:
    def __init__(self):
        self.landed = False
        self.synchronized = False

    def query(self):
        return self.landed

    def synchronize(self):
        self.synchronized = self.landed = True


class _ScriptedWriteBack(DeviceToHostWriteBack):
    """The real queue logic, with copies that land when the test says so (no GPU needed)."""

    def __init__(self):
        super().__init__("cpu")
        self.stream, self.events = object(), []

    def _launch(self, tensors):
        self.events.append(_Event())
        return self.events[-1], [t.clone() for t in tensors]


def test_write_back_applies_in_submission_order_whatever_lands_first():
    wb, applied = _ScriptedWriteBack(), []
    for i in range(3):
        wb.submit(lambda t: applied.append(int(t)), torch.tensor(i))
    assert applied == [] and len(wb) == 3
    wb.events[1].landed = True  # the second copy lands first: it must wait for the first
    wb.poll()
    assert applied == []
    wb.events[0].landed = True
    wb.poll()
    assert applied == [0, 1] and len(wb) == 1
    wb.drain()  # a reader waits for the rest
    assert applied == [0, 1, 2] and wb.events[2].synchronized and len(wb) == 0


def test_host_tier_read_waits_for_pending_write_backs():
    store = HiddenStore(LAYOUT, 8, torch.float32, "cpu", "host")
    store.write_back = _ScriptedWriteBack()
    store.write_hidden(8, torch.tensor([2]), torch.full((1, 16), 3.0))
    assert store.pending_write_backs() == 1  # not landed yet: the store still holds zeros
    assert store.read_hidden(8, torch.tensor([2])).eq(3).all()  # the read drained it first
    assert store.pending_write_backs() == 0


def test_host_tier_tail_fetch_reads_the_slots_once(monkeypatch):
    """N7: the host gathers a hit's rows, so the host tier reads the tail's slot ids from the device (a sync on a
    GPU): once for the token ids and every stored group, not once per table."""
    store = HiddenStore(LAYOUT, 16, torch.float32, "cpu", "host")
    store.write_back = _ScriptedWriteBack()
    store.write_hidden(8, torch.tensor([2]), torch.full((1, 16), 3.0))
    slots = torch.tensor([2, 5])
    moved = count_tensor_calls(monkeypatch, ("to",))
    loads = store.fetch_tail(slots, HostToDevice("cpu"))
    monkeypatch.undo()
    assert len(moved) == 1 and store.pending_write_backs() == 0
    assert set(loads) == {TOKENS, 4, 8} and loads[8][0].eq(3.0).all()


def test_host_tier_move_stays_on_the_host_after_draining(tmp_path):
    """N3 (GPU path review): a move on the host tier reads rows into host memory; handing them to the write-back,
    whose copies start from the device, made it call `record_stream` on a host tensor (NotImplementedError on any
    GPU, at NGRAM's first verify). The move drains the earlier write-backs, copies in place and submits nothing."""
    store = HiddenStore(LAYOUT, 8, torch.float32, "cpu", "host")
    store.write_back = wb = _ScriptedWriteBack()
    store.write_hidden(8, torch.tensor([2, 3]), torch.tensor([[5.0] * 16, [6.0] * 16]))
    assert len(wb) == 1  # still on its way
    store.move(torch.tensor([0, 1]), torch.tensor([2, 3]))
    assert len(wb.events) == 1 and len(wb) == 0  # drained, and the move launched no copy of its own
    assert store.read_hidden(8, torch.tensor([0, 1]))[:, 0].tolist() == [5.0, 6.0]


def test_hicache_host_twin_drains_the_write_back_before_it_copies():
    """N2: on the host tier the last forwards' rows may still be queued for the store when HiCache backs their KV up;
    the host twin drains the queue first, so the host copy (and L3 after it) holds those rows, not the slots' old
    ones. A load-back drains too, so no older write-back lands on the rows it brought."""
    from tailreplay_sglang.store.hicache_pool import HiddenHostPool

    store = HiddenStore(LAYOUT, 8, torch.float32, "cpu", "host")
    store.write_back = _ScriptedWriteBack()
    host = HiddenHostPool(store, 8, 1)
    store.write_hidden(4, torch.tensor([4]), torch.full((1, 16), 7.0))  # layer 4: row 0
    host.backup_from_device_all_layer_physical(store, torch.tensor([1]), torch.tensor([4]), "direct")
    assert host.hiddens[0, 1].eq(7.0).all()
    store.write_hidden(4, torch.tensor([4]), torch.full((1, 16), 9.0))  # a stale write to a slot about to be loaded
    host.load_to_device_per_layer_physical(store, torch.tensor([1]), torch.tensor([4]), 0, "direct")
    store.drain()
    assert store.read_hidden(4, torch.tensor([4])).eq(7.0).all()


def _args(**kw):
    return argparse.Namespace(**{"device": None, "disable_cuda_graph": False, **kw})


@pytest.mark.parametrize("kw,given,expected", [
    ({"device": "cpu"}, None, "device"),
    ({"device": "cpu"}, "host", "host"),  # the same code, synchronous copies
    ({"device": "cuda", "disable_cuda_graph": True}, None, "host"),
    ({"device": "cuda"}, None, "host"),  # CUDA graphs on: captured forwards stage their rows (store/staging.py)
    ({"device": "cuda"}, "device", "device"),
    ({"device": "cuda"}, "host", "host"),
])
def test_tier_is_chosen_for_the_device(kw, given, expected):
    assert _hidden_tier(TailReplayConfig(enabled=True, hidden_tier=given), _args(**kw)) == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_write_back_is_asynchronous_and_lands():
    store = HiddenStore(LAYOUT, 1 << 14, torch.bfloat16, "cuda", "host")
    assert store.hiddens.is_pinned() and store.device_nbytes == 0
    slots = torch.arange(1, 1 << 13, device="cuda")
    values = torch.randn(slots.numel(), 16, device="cuda")
    store.write_hidden(4, slots, values)
    got = store.read_hidden(4, slots)
    assert got.is_pinned() and torch.equal(got.cuda(), values.to(torch.bfloat16))


@pytest.mark.parametrize("tier,extra", [("device", True), ("host", False)])
def test_only_the_device_tier_is_charged_to_the_kv_cell(tmp_path, tier, extra):
    """The pool configurator sizes the KV pool by bytes per token: the device-tier store adds its bytes (fewer
    tokens fit), the host-tier store adds none (the device pool keeps its stock size)."""
    pytest.importorskip("sglang")  # a lent GPU runs this file without SGLang (scripts/gpu_check.sh)
    from types import SimpleNamespace

    from transformers import AutoConfig

    from tailreplay_sglang import lifecycle
    from tailreplay_sglang.runtime import TailReplayRuntime
    from tailreplay_sglang.store.hidden_store import bytes_per_token
    from tailreplay_eval.models import build_model

    hf_config = AutoConfig.from_pretrained(build_model("tiny-qwen35", tmp_path / "m"))
    kvc = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config, dtype=torch.float32))
    runtime = TailReplayRuntime(TailReplayConfig(enabled=True, hidden_tier=tier))
    cell = lifecycle.add_store_to_cell_size(runtime, lambda *args: 1000, None, kvc, 8)
    store = bytes_per_token(HybridLayout.from_hf_config(hf_config), torch.float32)  # auto: the model dtype
    assert cell == 1000 + (store if extra else 0)


@pytest.mark.parametrize("magnitude", [1e-4, 1.0, 3e3])
def test_float8_rows_decode_within_e4m3_rounding_of_what_was_written(magnitude):
    """float8 hiddens: e4m3 keeps 3 mantissa bits, so each value comes back within 2^-4 of itself (plus the subnormal
    step of its row's scale); one scale per token keeps a small row as precise as a large one beside it."""
    from tailreplay_sglang.store.hidden_store import bytes_per_token

    store = HiddenStore(LAYOUT, 8, torch.float8_e4m3fn, DEVICE, "device")
    assert store.hiddens.dtype == torch.uint8 and bytes_per_token(LAYOUT, torch.float8_e4m3fn) == 2 * (16 + 8) + 8
    g = torch.Generator().manual_seed(0)
    values = torch.randn(3, 16, generator=g, dtype=torch.float64) * torch.tensor([[magnitude], [1.0], [1e-3]])
    slots = torch.tensor([1, 2, 3], device=DEVICE)
    store.write_hidden(4, slots, values.float().to(DEVICE))
    got = store.decode(store.read_hidden(4, slots), torch.float32).cpu().double()
    step = values.abs().amax(-1, keepdim=True) / 448 * 2 ** -9  # e4m3's smallest subnormal, scaled
    assert ((got - values).abs() <= values.abs() / 16 + step).all()
    assert (got - values).abs().max() > 0  # it is lossy: the test would pass vacuously on a float32 store


@pytest.mark.parametrize("magnitude", [1e-4, 1.0, 3e3])
def test_int4_rows_decode_within_half_a_step_of_their_groups_scale(magnitude):
    """int4 hiddens: each group of 32 values comes back within half a code step (its amax / 7, kept in bfloat16) of
    itself, so one group's outlier coarsens only that group; a row is 32 code bytes + 4 scale bytes for 64 values,
    padded to 40 (whole 8-byte words)."""
    from tailreplay_sglang.store.hidden_store import bytes_per_token

    store = HiddenStore(INT4_LAYOUT, 8, torch.int4, DEVICE, "device")
    assert store.hiddens.dtype == torch.uint8 and bytes_per_token(INT4_LAYOUT, torch.int4) == 2 * 40 + 8
    g = torch.Generator().manual_seed(0)
    values = torch.randn(3, 64, generator=g, dtype=torch.float64) * torch.tensor([[magnitude], [1.0], [1e-3]])
    values[1, 40] = 50.0  # an outlier channel in the second group of row 1
    slots = torch.tensor([1, 2, 3], device=DEVICE)
    store.write_hidden(4, slots, values.float().to(DEVICE))
    got = store.decode(store.read_hidden(4, slots), torch.float32).cpu().double()
    groups = values.unflatten(-1, (2, 32))
    step = (groups.abs().amax(-1, keepdim=True) / 7).to(torch.bfloat16).double()
    assert ((got.unflatten(-1, (2, 32)) - groups).abs() <= step / 2 + groups.abs() * 2 ** -8 + 1e-30).all()
    assert (got[1, :32] - values[1, :32]).abs().max() < 50 / 7 / 20  # a twentieth of the outlier group's step
    assert (got - values).abs().max() > 0  # lossy: the test would pass vacuously on a float32 store


def test_int4_refuses_a_row_of_partial_groups_naming_the_flag():
    with pytest.raises(ValueError, match="--tail-replay-hidden-dtype int4.*multiple of 32.*48"):
        HiddenStore(HybridLayout(LAYOUT.layer_types, hidden_size=48), 8, torch.int4, DEVICE)
    assert TailReplayConfig(enabled=True, hidden_dtype="int4").hidden_torch_dtype(torch.float32) == torch.int4


# ---- the store's HiCache host pool (store/hicache_pool.py), as SGLang's controller and file backend call it ----

@pytest.mark.parametrize("dtype", ENCODINGS)
def test_hicache_host_pool_round_trips_rows_through_host_and_l3_pages(dtype):
    """Device slots -> host slots (a backup with the KV), host -> other device slots (a load-back into fresh KV
    slots), and host pages -> bytes -> another server's host pool (the file backend's write and read) all give back
    the rows and token ids that were stored, for each encoding."""
    from tailreplay_sglang.store.hicache_pool import HiddenHostPool

    page = 4
    store = HiddenStore(_layout_for(dtype), 64, dtype, DEVICE)
    _fill(store, seed=3)
    pool = HiddenHostPool(store, size=32, page_size=page)
    dev = torch.arange(8, 20, device=DEVICE)  # 12 tokens = 3 pages of KV, stored at host slots 16..27
    host = torch.arange(16, 28)
    pool.backup_from_device_all_layer_physical(store, host, dev, "direct")
    fresh = torch.arange(40, 52, device=DEVICE)
    pool.load_to_device_per_layer_physical(store, host, fresh, 0, "direct")
    for layer in (4, 8):
        assert torch.equal(store.read_hidden(layer, fresh), store.read_hidden(layer, dev))
    assert torch.equal(store.read_tokens(fresh), store.read_tokens(dev))

    other = HiddenHostPool(store, size=32, page_size=page)  # a second server's pool, reading the file backend
    for start in range(16, 28, page):
        data = pool.get_data_page(start)
        assert data.dtype == torch.uint8 and data.numel() == page * pool.size_per_token
        landing = other.get_dummy_flat_data_page()
        landing.copy_(data)
        other.set_from_flat_data_page(start - 16, landing)  # a different host slot on the other server
    assert torch.equal(other.hiddens[:, :12].view(torch.uint8), pool.hiddens[:, 16:28].view(torch.uint8))
    assert torch.equal(other.token_ids[:12], pool.token_ids[16:28]) and other.token_ids[:12].any()


def _indexed_copy_contract(src, dst, src_indices, dst_indices, item_size):
    """sgl-kernel's `transfer_kv_per_layer_mla` by its contract (what SGLang's mamba host pool relies on): item i of
    a table is the `item_size` bytes at its base + i * item_size, so each table's items must be contiguous and of
    that size; indices are int64 on the device (the controller's `move_indices` for `kernel`)."""
    for table in (src, dst):
        assert table.stride(0) * table.element_size() == item_size == table[0].numel() * table.element_size()
    assert item_size % 8 == 0  # it moves 8-byte words: the rest of a row would be dropped
    assert src_indices.dtype == dst_indices.dtype == torch.int64
    assert src_indices.device.type == dst_indices.device.type == DEVICE
    as_items = lambda t: t.view(torch.uint8).view(t.shape[0], item_size)  # noqa: E731
    as_items(dst)[dst_indices] = as_items(src)[src_indices]


@pytest.mark.skipif(DEVICE == "cuda", reason="a CPU stand-in for sgl-kernel's copy: on CUDA the kernel is SGLang's")
def test_hicache_host_pool_kernel_backend_moves_rows_without_reading_on_the_host(monkeypatch):
    """N6 (GPU path review): with SGLang's default io backend the controller hands the host twin its indices on the
    device, and the copies run on a transfer stream fenced behind the forward; a `.cpu()` of the indices, or a
    gather into pageable memory and a blocking `.to()`, made the scheduler thread wait for that forward at every
    backup and load-back. The twin uses SGLang's indexed copy there (stood in for by its contract): rows round-trip
    and nothing is read on, or copied to, the host outside the kernel."""
    from tailreplay_sglang.store.hicache_pool import HiddenHostPool

    store = HiddenStore(LAYOUT, 64, torch.bfloat16, DEVICE)
    _fill(store, seed=7)
    pool = HiddenHostPool(store, size=32, page_size=1, kernel_copy=_indexed_copy_contract)
    dev, host, fresh = (torch.arange(a, a + 12, device=DEVICE) for a in (8, 16, 40))
    reads = count_tensor_calls(monkeypatch, (*HOST_READS, "cpu", "to", "numpy"))
    pool.backup_from_device_all_layer_physical(store, host, dev, "kernel")
    pool.load_to_device_per_layer_physical(store, host, fresh, 0, "kernel")
    monkeypatch.undo()
    assert reads == []
    for layer in (4, 8):
        assert torch.equal(store.read_hidden(layer, fresh), store.read_hidden(layer, dev))
    assert torch.equal(store.read_tokens(fresh), store.read_tokens(dev)) and store.read_tokens(dev).any()


@pytest.mark.parametrize("hidden, kernel", [(16, True), (12, False)])
def test_hicache_host_pool_moves_float8_rows_with_the_kernel_where_they_are_whole_words(hidden, kernel):
    """float8 rows carry their 4-byte scale in an 8-byte slot: with a hidden size that is a multiple of 8 (every
    published model's) a row is whole 8-byte words and goes through the kernel on its backend (review F: with a
    4-byte slot it fell back to torch and its blocking index copies); otherwise (12 + 8 = 20 bytes here) torch moves
    it. Either way it round-trips."""
    import dataclasses

    from tailreplay_sglang.store.hicache_pool import HiddenHostPool

    layout = dataclasses.replace(LAYOUT, hidden_size=hidden)
    store = HiddenStore(layout, 64, torch.float8_e4m3fn, DEVICE)
    store.hiddens.copy_(torch.randint(0, 255, store.hiddens.shape, dtype=torch.uint8))
    called = []

    def stand_in(**kw):
        called.append(kw["item_size"])
        _indexed_copy_contract(**kw)

    pool = HiddenHostPool(store, size=32, page_size=1, kernel_copy=stand_in)
    dev, host, fresh = (torch.arange(a, a + 12, device=DEVICE) for a in (8, 16, 40))
    pool.backup_from_device_all_layer_physical(store, host, dev, "kernel")
    pool.load_to_device_per_layer_physical(store, host, fresh, 0, "kernel")
    assert set(called) == ({hidden + 8, 8} if kernel else set())  # each group's rows, and the token ids
    assert torch.equal(store.hiddens[:, fresh], store.hiddens[:, dev])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hicache_host_pool_hands_a_zero_copy_backend_each_pages_bytes_in_place(dtype):
    """Mooncake reads and writes a page where it lies (`get_page_buffer_meta`: an address and a size per part,
    parts of one page packed into one object): the bytes at those addresses, in order, are the page `get_data_page`
    gives the file backend, and they lie inside the buffers it registers (`get_hybrid_pool_buffer`)."""
    import ctypes

    from tailreplay_sglang.store.hicache_pool import HiddenHostPool

    page = 4
    store = HiddenStore(LAYOUT, 64, dtype, DEVICE)
    _fill(store, seed=5)
    pool = HiddenHostPool(store, size=32, page_size=page)
    pool.backup_from_device_all_layer_physical(store, torch.arange(8, 28), torch.arange(20, 40, device=DEVICE),
                                               "direct")
    host = torch.tensor([12, 13, 14, 15, 24, 25, 26, 27])  # two pages, not adjacent
    ptrs, sizes = pool.get_page_buffer_meta(host)
    parts = len(ptrs) // 2
    assert parts == store.hiddens.shape[0] + 1 and len(sizes) == len(ptrs)
    registered = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in pool.get_hybrid_pool_buffer()]
    for i, start in enumerate((12, 24)):
        page_ptrs, page_sizes = ptrs[i * parts:(i + 1) * parts], sizes[i * parts:(i + 1) * parts]
        got = b"".join(ctypes.string_at(p, n) for p, n in zip(page_ptrs, page_sizes))
        assert got == pool.get_data_page(start).numpy().tobytes()
        assert all(any(lo <= p and p + n <= hi for lo, hi in registered) for p, n in zip(page_ptrs, page_sizes))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_host_twin_as_init_hicache_builds_it_on_a_gpu_moves_rows_with_sglangs_kernel(dtype):
    """Issue 65 class 8, natively on CUDA where SGLang with sgl-kernel is installed (scripts/gpu_check.sh's serving
    machine): the twin `init_hicache` builds (pinned host rows of a device-tier store) binds SGLang's own indexed copy
    and round-trips every group's rows and the token ids through it, float8 rows included (their 8-byte scale slot
    makes them whole words)."""
    from tailreplay_sglang.store.hicache_pool import HiddenHostPool, sglang_indexed_copy

    if DEVICE != "cuda":
        pytest.skip("pinned memory and sgl-kernel's copy exist on CUDA only")
    try:
        kernel = sglang_indexed_copy()
    except ImportError as e:
        pytest.skip(f"SGLang is not installed here: {e}")
    if kernel is None:
        pytest.skip("this SGLang binds no indexed copy (no sgl-kernel)")
    store = HiddenStore(LAYOUT, 64, dtype, DEVICE)
    store.hiddens.copy_(torch.randint(0, 255, store.hiddens.shape, dtype=torch.uint8).view(store.hiddens.dtype)
                        if dtype == torch.float8_e4m3fn else torch.randn(store.hiddens.shape).to(dtype))
    store.token_ids.copy_(torch.randint(0, 1000, store.token_ids.shape))
    pool = HiddenHostPool(store, size=32, page_size=1, pin_memory=True)  # as `init_hicache` builds it on CUDA
    assert pool.kernel_copy is kernel and pool.hiddens.is_pinned() and pool.token_ids.is_pinned()
    dev, host, fresh = (torch.arange(a, a + 12, device=DEVICE) for a in (8, 16, 40))
    pool.backup_from_device_all_layer_physical(store, host, dev, "kernel")
    pool.load_to_device_per_layer_physical(store, host, fresh, 0, "kernel")
    torch.cuda.synchronize()
    assert torch.equal(store.hiddens[:, fresh].view(torch.uint8), store.hiddens[:, dev].view(torch.uint8))
    assert torch.equal(store.token_ids[fresh], store.token_ids[dev])


def test_the_overlapped_copy_stream_is_drawn_once_and_is_never_the_forward_stream(monkeypatch):
    """GPU path review K: PyTorch hands `torch.cuda.Stream()` out round-robin from a fixed pool, so a copy stream
    drawn per replay pass could be the forwards' own stream (the copies serialized behind the replay). With a
    round-robin pool of three whose next draw is the current stream: the copy stream is another one, and every later
    pass gets that same stream without a draw."""
    from tailreplay_sglang.store import transfer

    pool = ["s0", "forward", "s2"]
    draws = []

    def draw(device):
        draws.append(pool[len(draws) % len(pool)])
        return draws[-1]

    monkeypatch.setattr(transfer, "_COPY_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", draw)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "forward")
    draws.append("s_before")  # the pool's next draw is the forwards' stream
    cuda = torch.device("cuda", 0)
    assert transfer.copy_stream(cuda) == "s2" and draws == ["s_before", "forward", "s2"]
    assert [transfer.copy_stream(cuda) for _ in range(3)] == ["s2"] * 3 and len(draws) == 3


def test_the_overlapped_copy_stream_on_cuda_is_one_stream_not_the_current_one():
    """K natively (scripts/gpu_check.sh): two replay passes' loaders share one copy stream, not the current one."""
    if DEVICE != "cuda":
        pytest.skip("CUDA streams exist on CUDA only")
    first, second = HostToDevice(DEVICE, "ovl"), HostToDevice(DEVICE, "ovl")
    assert first.stream is second.stream and first.stream != torch.cuda.current_stream()
