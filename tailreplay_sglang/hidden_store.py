"""Per-token replay inputs, addressed by the token's KV slot index.

The store shares the FA KV pool's index space: the radix tree's KV indices address it, and freeing a KV slot frees
its entry (nothing to track separately). Per slot it keeps the token id (group 0 replays from the embeddings) and,
for each stored group, the residual-stream value entering the group's first GDN layer.
"""

import logging

import torch

from tailreplay_sglang.layout import HybridLayout

logger = logging.getLogger(__name__)

TOKEN_ID_BYTES = 8  # int64, what embeddings take


def bytes_per_token(layout: HybridLayout, dtype: torch.dtype) -> int:
    return layout.bytes_per_token(dtype.itemsize) + TOKEN_ID_BYTES


class HiddenStore:
    def __init__(self, layout: HybridLayout, num_slots: int, dtype: torch.dtype, device):
        self.layout = layout
        self._row = {g.first_layer: i for i, g in enumerate(layout.stored_groups)}
        self.hiddens = torch.zeros(len(self._row), num_slots, layout.hidden_size, dtype=dtype, device=device)
        self.token_ids = torch.zeros(num_slots, dtype=torch.int64, device=device)
        logger.info("Tail-Replay hidden store: %d slots x %d B/token = %.1f MiB (%d stored groups, %s)",
                    num_slots, bytes_per_token(layout, dtype), self.nbytes / 2**20, len(self._row), dtype)

    @property
    def nbytes(self) -> int:
        return self.hiddens.numel() * self.hiddens.element_size() + self.token_ids.numel() * TOKEN_ID_BYTES

    def is_stored(self, first_layer: int) -> bool:
        return first_layer in self._row

    def write_tokens(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.token_ids[slots] = token_ids.to(torch.int64)

    def write_hidden(self, first_layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.hiddens[self._row[first_layer], slots] = values.to(self.hiddens.dtype)

    def read_tokens(self, slots: torch.Tensor) -> torch.Tensor:
        return self.token_ids[slots]

    def read_hidden(self, first_layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.hiddens[self._row[first_layer], slots]
