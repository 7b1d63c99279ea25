"""A dtype SGLang 0.5.23's Kimi Linear gets wrong, corrected on every device (a `before` row of `hooks.ALWAYS`).

`KimiDeltaAttention` builds its batched forget-gate / output-gate projection (`ColumnParallelBatchedLinear`) in
`config.dtype`, the checkpoint's dtype, while every other weight is created in the serving dtype (`--dtype`, the
default dtype while SGLang builds the model). Served in any other dtype, the first KDA forward fails: "expected m1
and m2 to have the same dtype, but got: float != c10::BFloat16" (a bfloat16 checkpoint with `--dtype float32`),
"expected scalar type Float but found Half" (a float32 one with `--dtype auto`, which serves float16).
"""

import torch


def batched_linear_in_serving_dtype(self, batch, input_size, output_size, dtype=None, **kwargs):
    """BEFORE `ColumnParallelBatchedLinear.__init__`: its parameter in the dtype the model is being built in."""
    return (self, batch, input_size, output_size), dict(kwargs, dtype=torch.get_default_dtype())
