"""Device-independent torch ops of the GDN recurrence, used on every device.

- `gdn`: gating, chunked varlen prefill (WY form, 64-token chunks, optionally the state entering each chunk),
  batched recurrent decode; states in SGLang's `[slots, HV, V, K]` pool layout.
- `conv`: depthwise causal conv1d for packed varlen prefill and decode, conv states in a slot pool.
- `naive`: token-by-token float64 references for both (tests, and the Triton kernels' references).

The replay runs them on CPU tensors (`kernels.replay`); the CPU fallback (`cpu/sgl_kernel_shim.py`) serves them to
SGLang as sgl-kernel's ops.
"""
