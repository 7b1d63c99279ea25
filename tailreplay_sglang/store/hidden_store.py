"""Per-token replay inputs, addressed by the token's KV slot index.

The store shares the FA KV pool's index space: the radix tree's KV indices address it, and freeing a KV slot frees
its entry (nothing to track separately). Per slot it keeps the token id (group 0 replays from the embeddings) and,
for each stored group, the residual-stream value entering the group's first GDN layer.

Two tiers (`--tail-replay-hidden-tier`):
- `device`: the store sits next to the KV pool, written and read in place;
- `host`: the store sits in (pinned) host memory and costs no device memory. Each forward's new entries go back
  asynchronously (`transfer.DeviceToHostWriteBack`), and a hit fetches only its tail, host -> device, through
  `transfer.HostToDevice` (serialized or overlapped with the replay). Where host is the device (CPU), the same code
  runs with synchronous copies. Under CUDA graphs a captured forward writes into a device staging area instead,
  flushed to the write-back after each replay (`staging.GraphStaging`).

Rows are kept as `hidden_codec` encodes them (a float dtype, or float8 with a scale per token): reads return the
encoded rows, and the replay decodes them on the device (`decode`).

Under attention TP (N > 1 ranks replaying the same batch) the residual stream is replicated on every rank, while
each rank's KV is 1/N of the model's; a whole row on every rank would cost N times what it needs. So each rank keeps
its 1/N of the columns of every stored row (`Shard`: sliced locally at capture, no communication), and a replay
joins a group's parts with one all-gather over the attention-TP group before the group replays (`gather_columns`,
one collective per stored group per pass, in the same order on every rank). Everything that moves rows (HiCache's
host twin and storage, the host tier, speculative decoding's moves) moves the rank's part as it is.
"""

from dataclasses import dataclass

import logging

import torch

from tailreplay_sglang.config import HIDDEN_TIERS
from tailreplay_sglang.layout import HybridLayout
from tailreplay_sglang.store.codec import codec_for
from tailreplay_sglang.store.staging import GraphStaging, cuda_graph_capturing
from tailreplay_sglang.store.transfer import DeviceToHostWriteBack, HostToDevice, pin

logger = logging.getLogger(__name__)

TOKEN_ID_BYTES = 8  # int64, what embeddings take
TOKENS = "tokens"  # fetch key of the tail's token ids (group 0's input); stored groups use their first layer


@dataclass(frozen=True)
class Shard:
    """This rank's columns of every stored row: [rank * width, (rank + 1) * width) of the hidden size."""

    rank: int = 0
    world: int = 1
    group: object = None  # SGLang's attention-TP GroupCoordinator, whose all_gather joins the parts

    def width(self, hidden_size: int) -> int:
        return hidden_size // self.world

    def columns(self, hidden_size: int) -> slice:
        width = self.width(hidden_size)
        return slice(self.rank * width, (self.rank + 1) * width)

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        return part if self.world == 1 else self.group.all_gather(part.contiguous(), dim=-1)


def bytes_per_token(layout: HybridLayout, dtype: torch.dtype, shards: int = 1) -> int:
    """Per rank: each of `shards` attention-TP ranks keeps 1/shards of every row."""
    return bytes_per_token_of(len(layout.stored_groups), layout.row_width // shards, dtype)


def bytes_per_token_of(stored_groups: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Store bytes per token: one encoded row per stored group, and the token id."""
    return stored_groups * codec_for(dtype).row_bytes(hidden_size) + TOKEN_ID_BYTES


class HiddenStore:
    """`staging_rows`: the host tier's staging area under CUDA graphs (the most rows one replayed graph writes; 0:
    no graphs). `capturing` says whether the forward is being captured (a stand-in's in the contract tests)."""

    def __init__(self, layout: HybridLayout, num_slots: int, dtype: torch.dtype, device, tier: str = "device",
                 shard: Shard = Shard(), staging_rows: int = 0, capturing=cuda_graph_capturing):
        if tier not in HIDDEN_TIERS:
            raise ValueError(f"hidden store tier must be one of {HIDDEN_TIERS}, got {tier!r}")
        self.layout, self.tier, self.device, self.shard = layout, tier, torch.device(device), shard
        self._columns = shard.columns(layout.row_width)
        self._row = {g.first_layer: i for i, g in enumerate(layout.stored_groups)}
        self.codec = codec_for(dtype)
        where = self.device if tier == "device" else torch.device("cpu")
        self.hiddens = torch.zeros(len(self._row), num_slots, self.codec.row_width(shard.width(layout.row_width)),
                                   dtype=self.codec.storage_dtype, device=where)
        self.token_ids = torch.zeros(num_slots, dtype=torch.int64, device=where)
        if tier == "host":
            self.hiddens, self.token_ids = pin(self.hiddens), pin(self.token_ids)
        self.write_back = DeviceToHostWriteBack(self.device) if tier == "host" else None
        staged = tier == "host" and staging_rows > 0
        self.staging = GraphStaging(self._tables(), staging_rows, self.device) if staged else None
        self._capturing = capturing
        logger.info("Tail-Replay hidden store (%s tier): %d slots x %d B/token = %.1f MiB (%d stored groups, %s; "
                    "columns %d:%d of %d on attention-TP rank %d of %d)", tier, num_slots,
                    bytes_per_token(layout, dtype, shard.world), self.nbytes / 2**20, len(self._row), dtype,
                    self._columns.start, self._columns.stop, layout.row_width, shard.rank, shard.world)

    @property
    def nbytes(self) -> int:
        return self.hiddens.numel() * self.hiddens.element_size() + self.token_ids.numel() * TOKEN_ID_BYTES

    @property
    def device_nbytes(self) -> int:
        """What the store costs in device memory (for the host tier on a GPU: its graph staging area only)."""
        if self.hiddens.device == self.device:
            return self.nbytes
        return 0 if self.staging is None else self.staging.nbytes

    def _tables(self) -> list[torch.Tensor]:
        return [self.token_ids, *self.hiddens]

    def is_stored(self, first_layer: int) -> bool:
        return first_layer in self._row

    # ---- writes: every forward, on the compute stream ----

    def write_tokens(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        self._write(0, slots, token_ids.to(torch.int64))

    def write_hidden(self, first_layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        self._write(1 + self._row[first_layer], slots, self.codec.encode(values[..., self._columns]))

    def _write(self, table: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        target = self._tables()[table]
        if self.write_back is None:
            target[slots] = values
        elif self.staging is not None and self._capturing():
            self.staging.write(table, slots, values)
        else:
            self.write_back.submit(lambda s, v: target.index_copy_(0, s.long(), v), slots, values)

    def flush_staging(self, n: int) -> None:
        """After a replayed CUDA graph (outside it): the first `n` staged rows of each table to the write-back."""
        if self.staging is not None:
            self.staging.flush(n, self._tables(), self.write_back)

    def move(self, target_slots: torch.Tensor, source_slots: torch.Tensor) -> None:
        """Rows `source_slots` -> `target_slots` (every source read before any target is written): speculative
        decoding with a draft tree moves the accepted tokens' KV to the front of their block
        (`KVCache.move_kv_cache`), and their hidden rows and token ids follow. On the host tier the rows never
        leave the host: the read drained every earlier write-back, so a copy in place comes after them all (the
        write-back copies device tensors only; a host one would fail its `record_stream` on a GPU)."""
        for table in (self.token_ids, *self.hiddens):
            rows = self._read(table, source_slots)
            if self.write_back is None:
                table[target_slots] = rows
            else:
                table.index_copy_(0, target_slots.to(table.device, torch.int64), rows)

    def drain(self) -> None:
        """Apply every pending write-back (host tier): what a reader of the host tables outside `_read` calls
        first (HiCache's host twin, `hicache_pool.py`)."""
        if self.write_back is not None:
            self.write_back.drain()

    # ---- reads: a hit's tail ----

    def read_tokens(self, slots: torch.Tensor) -> torch.Tensor:
        return self._read(self.token_ids, slots)

    def read_hidden(self, first_layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The encoded rows (what travels to the device); `decode` turns them into values."""
        return self._read(self.hiddens[self._row[first_layer]], slots)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The values of a tail's encoded rows, whole: this rank's part joined with the other ranks' (`Shard`)."""
        return self.shard.gather(self.codec.decode(rows, dtype))

    def _read(self, source: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if self.write_back is None:
            return source[slots]
        return _gather(source, self._host_slots(slots))

    def _host_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Host tier: the slot ids on the host, once every earlier forward's entries have landed. Both wait for the
        device (the host gathers the rows): what the host tier pays per read for holding no device memory."""
        self.write_back.drain()
        return slots.to("cpu", torch.int64)

    def fetch_tail(self, slots: torch.Tensor, h2d: HostToDevice) -> dict:
        """Launch the loads of every replay input of a tail (token ids, then each stored group in order) and
        return them by key (`TOKENS` or a group's first layer); read one after `h2d.wait(key)`. The host tier
        reads the slots once for all of them (GPU path review N7)."""
        tables = {TOKENS: self.token_ids, **{layer: self.hiddens[row] for layer, row in self._row.items()}}
        if self.write_back is None:
            return {key: h2d.copy(key, table[slots]) for key, table in tables.items()}
        idx = self._host_slots(slots)
        return {key: h2d.copy(key, _gather(table, idx)) for key, table in tables.items()}

    def pending_write_backs(self) -> int:
        if self.write_back is None:
            return 0
        self.write_back.poll()
        return len(self.write_back)


def _gather(source: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows `idx` of a host table, gathered straight into pinned memory where it is pinned: H2D-ready."""
    out = torch.empty((idx.numel(), *source.shape[1:]), dtype=source.dtype, pin_memory=source.is_pinned())
    return torch.index_select(source, 0, idx, out=out)
