"""Torch bodies of the Mamba2 and KDA kernels SGLang calls on a CPU, which only this port calls.

- `ssd`: Mamba2's chunked SSD scan (per-chunk states, states at requested positions) and one-token decode update;
- `kda`: KDA's chunked prefill (per-chunk states) and one-token decode update.

They build on the plugin's `tailreplay_sglang.ops` (GDN's scan helpers, Mamba2's `dt`, KDA's gate), which the
plugin's replay uses too; GDN and the causal conv are served from there directly (`sgl_kernel_shim`).
"""
