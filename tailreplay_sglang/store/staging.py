"""The host tier under CUDA graphs: what a captured forward writes lands in device buffers of fixed addresses, and
the copy to host runs after each replayed graph, outside it.

A CUDA graph keeps the kernels its capture launched, with their addresses, and nothing else: no Python runs at
replay, so the host tier's write-back (`transfer.DeviceToHostWriteBack`: a pinned buffer, a side stream, an event,
a host-side apply) cannot be part of one. Under capture the store therefore writes each table's new rows and their
slot ids into a `GraphStaging` buffer instead, with two device copies that the graph replays; after every replay
the graph runner's hook (`lifecycle.flush_after_graph`) calls `flush`, which snapshots the rows the replay wrote,
marks the buffers empty again and hands the snapshot to the write-back, in forward order like an eager forward's
rows. A row whose slot id is still -1 was not written by this replay (the forward's capture point ran eagerly, as
under the breakable prefill graph, or the batch was padded) and is skipped on the host.

Contract tests (`tests/test_graph_staging.py`) run the capture under a CUDA graph stand-in on the CPU.
"""

from functools import partial

import torch

EMPTY = -1  # the slot id of a staging row no replay has written since the last flush


def cuda_graph_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class GraphStaging:
    """One device buffer of `capacity` rows (and their slot ids) per host table of the store."""

    def __init__(self, tables: list[torch.Tensor], capacity: int, device):
        self.capacity = capacity
        self.slots = [torch.full((capacity,), EMPTY, dtype=torch.int64, device=device) for _ in tables]
        self.rows = [torch.zeros((capacity, *t.shape[1:]), dtype=t.dtype, device=device) for t in tables]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.slots, *self.rows))

    def write(self, table: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Inside a captured graph: device copies into the fixed buffers (the graph's batch size is fixed)."""
        n = slots.shape[0]
        if n > self.capacity:
            raise RuntimeError(f"Tail-Replay's host tier stages {self.capacity} rows per CUDA graph replay, and this "
                               f"graph captures {n}: raise the staging rows (lifecycle.graph_staging_rows)")
        self.slots[table][:n].copy_(slots)
        self.rows[table][:n].copy_(values)

    def flush(self, n: int, tables: list[torch.Tensor], write_back) -> None:
        """After a replay, outside the graph: rows [0, n) of each table to the write-back (copies, so that the next
        replay may overwrite the buffers while they travel), then every slot id back to EMPTY."""
        n = min(n, self.capacity)
        for slots, rows, table in zip(self.slots, self.rows, tables):
            written_slots, written_rows = slots[:n].clone(), rows[:n].clone()
            slots.fill_(EMPTY)
            write_back.submit(partial(apply_written, table), written_slots, written_rows)


def apply_written(table: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """On the host: the staged rows a replay wrote (slot id not EMPTY) into their slots, in order."""
    written = slots != EMPTY
    table.index_copy_(0, slots[written], rows[written])
