"""How a stored hidden row is encoded: as is in a float dtype, as float8 (e4m3) with one float32 scale per token
(`--tail-replay-hidden-dtype float8_e4m3fn`), or as 4-bit integers with one bfloat16 scale per 32 values
(`--tail-replay-hidden-dtype int4`).

A float8 row is `hidden_size` e4m3 bytes followed by an 8-byte slot holding the 4 bytes of its scale, all in one
uint8 row, so that the store, the host tier's write-back and the tail fetch move one tensor per group whatever the
encoding; the replay decodes on the device. The slot is 8 bytes, not 4, so that a row of a hidden size that is a
multiple of 8 is a whole number of 8-byte words, which is what SGLang's indexed copy kernel moves (HiCache's host
twin, `hicache_pool.py`); with a 4-byte slot float8 rows fell back to a blocking torch copy (GPU path review F).
One scale per token and group (amax / 448, e4m3's largest value): residual-stream rows differ in magnitude by orders
between tokens (the first tokens' massive activations), so one scale per group would crush the small rows.
"""

import math

import torch

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = torch.finfo(FLOAT8).max  # 448
SCALE_BYTES = 4  # one float32 per token row ...
SCALE_SLOT = 8  # ... in an 8-byte slot at the row's end (its last 4 bytes zero)
WORD = 8  # the bytes SGLang's indexed copy kernel moves at a time: every encoded row is whole words

# torch.int4 names the encoding (the flag's value, `/server_info`'s hidden_dtype); no tensor has that dtype.
INT4 = torch.int4
INT4_GROUP = 32  # values per scale: a residual-stream row's outlier channels only coarsen their own group
INT4_MAX = 7  # symmetric codes -7..7, stored offset by 8 in a nibble


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


class Int4Codec:
    """Rows kept as 4-bit codes, two to a byte, times a bfloat16 scale per INT4_GROUP values (amax / 7): a quarter
    of bfloat16's bytes plus 1/16 for the scales. The row is [codes: width / 2 B][scales: width / 16 B], padded to
    whole 8-byte words. A rank's part of a row (`hidden_store.Shard`) must be whole groups."""

    dtype = INT4
    storage_dtype = torch.uint8

    def row_width(self, hidden_size: int) -> int:
        self.check(hidden_size)
        packed = hidden_size // 2 + hidden_size // INT4_GROUP * 2
        return math.ceil(packed / WORD) * WORD

    row_bytes = row_width

    @staticmethod
    def check(hidden_size: int) -> None:
        if hidden_size % INT4_GROUP:
            raise ValueError(f"--tail-replay-hidden-dtype int4 scales groups of {INT4_GROUP} values, so each stored "
                             f"row's width must be a multiple of {INT4_GROUP}; this one is {hidden_size} (the hidden "
                             f"size, divided by the attention-TP size where the store is sharded)")

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        width = values.shape[-1]
        groups = values.float().unflatten(-1, (width // INT4_GROUP, INT4_GROUP))
        scale = (groups.abs().amax(dim=-1, keepdim=True) / INT4_MAX).to(torch.bfloat16)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: codes 0 whatever the scale
        codes = (torch.round(groups / scale.float()).clamp(-INT4_MAX, INT4_MAX) + 8).to(torch.uint8).flatten(-2)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        row = torch.cat([packed, scale.flatten(-2).view(torch.uint8)], dim=-1)
        return torch.nn.functional.pad(row, (0, self.row_width(width) - row.shape[-1]))

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        width = self._width(rows.shape[-1])
        packed = rows[..., :width // 2]
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).float() - 8
        scale = rows[..., width // 2:width // 2 + width // INT4_GROUP * 2].contiguous().view(torch.bfloat16)
        values = codes.unflatten(-1, (width // INT4_GROUP, INT4_GROUP)) * scale.float().unsqueeze(-1)
        return values.flatten(-2).to(dtype)

    def _width(self, row_width: int) -> int:
        """The values in a row of `row_width` bytes (the inverse of `row_width`, padding aside)."""
        width = (row_width // (INT4_GROUP // 2 + 2)) * INT4_GROUP
        while self.row_width(width + INT4_GROUP) <= row_width:
            width += INT4_GROUP
        while width and self.row_width(width) > row_width:
            width -= INT4_GROUP
        return width


def codec_for(dtype: torch.dtype):
    if dtype == FLOAT8:
        return Float8Codec()
    return Int4Codec() if dtype == INT4 else PlainCodec(dtype)
