"""Device-independent torch ops of the recurrences, used on every device.

- `gdn`: gating, chunked varlen prefill (WY form, 64-token chunks, optionally the state entering each chunk),
  batched recurrent decode; states in SGLang's `[slots, HV, V, K]` pool layout.
- `conv`: depthwise causal conv1d for packed varlen prefill and decode, conv states in a slot pool.
- `ssd`, `kda`: Mamba2's `dt` and KDA's gate, which the replay of those families takes its decays from.
- `naive`: token-by-token float64 references (tests, and the Triton kernels' references).

The replay runs `gdn` and `conv` on CPU tensors (`kernels.replay`). The CPU port, a separate package
(`sglang_cpu_compat`), serves them to SGLang as sgl-kernel's ops and builds its Mamba2 and KDA kernels on them; this
package never imports it.
"""
