"""How a stored hidden row is encoded: as is in a float dtype, or as float8 (e4m3) with one float32 scale per token
(`--tail-replay-hidden-dtype float8_e4m3fn`).

A float8 row is `hidden_size` e4m3 bytes followed by an 8-byte slot holding the 4 bytes of its scale, all in one
uint8 row, so that the store, the host tier's write-back and the tail fetch move one tensor per group whatever the
encoding; the replay decodes on the device. The slot is 8 bytes, not 4, so that a row of a hidden size that is a
multiple of 8 is a whole number of 8-byte words, which is what SGLang's indexed copy kernel moves (HiCache's host
twin, `hicache_pool.py`); with a 4-byte slot float8 rows fell back to a blocking torch copy (GPU path review F).
One scale per token and group (amax / 448, e4m3's largest value): residual-stream rows differ in magnitude by orders
between tokens (the first tokens' massive activations), so one scale per group would crush the small rows.
"""

import torch

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = torch.finfo(FLOAT8).max  # 448
SCALE_BYTES = 4  # one float32 per token row ...
SCALE_SLOT = 8  # ... in an 8-byte slot at the row's end (its last 4 bytes zero)


class PlainCodec:
    """Rows kept in a float dtype (rounded to it on write)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = self.storage_dtype = dtype

    def row_width(self, hidden_size: int) -> int:
        return hidden_size

    def row_bytes(self, hidden_size: int) -> int:
        return hidden_size * self.dtype.itemsize

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(self.dtype)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return rows.to(dtype)


class Float8Codec:
    """Rows kept as e4m3 values times a float32 scale per row."""

    dtype = FLOAT8
    storage_dtype = torch.uint8

    def row_width(self, hidden_size: int) -> int:
        return hidden_size + SCALE_SLOT

    def row_bytes(self, hidden_size: int) -> int:
        return hidden_size + SCALE_SLOT

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        values = values.float()
        scale = (values.abs().amax(dim=-1, keepdim=True) / FLOAT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        codes = (values / scale).to(FLOAT8).view(torch.uint8)
        pad = codes.new_zeros(*codes.shape[:-1], SCALE_SLOT - SCALE_BYTES)
        return torch.cat([codes, scale.view(torch.uint8), pad], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        codes = rows[..., :-SCALE_SLOT].contiguous().view(FLOAT8)
        scale = rows[..., -SCALE_SLOT:rows.shape[-1] - SCALE_SLOT + SCALE_BYTES].contiguous().view(torch.float32)
        return (codes.float() * scale).to(dtype)


def codec_for(dtype: torch.dtype):
    return Float8Codec() if dtype == FLOAT8 else PlainCodec(dtype)
