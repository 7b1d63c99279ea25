"""SGLang 0.5.23 on a CPU without AMX and without sgl-kernel: what its CPU engine lacks to serve hybrid models.

A port for development and tests, apart from the Tail-Replay plugin (`tailreplay_sglang`), which a GPU install runs
without it; `scripts/setup_cpu.sh` installs it. It may use the plugin's torch ops and hook table machinery; the plugin
never imports it.

- `fallback`: the import hook (installed by `sglang_cpu_compat.pth`, inert unless SGLang can only run its CPU engine)
  that serves `sgl_kernel` from `sgl_kernel_shim` and prepares or stubs `torchvision`;
- `sgl_kernel_shim`: sgl-kernel's CPU entry points on the plugin's torch ops (`tailreplay_sglang.ops`) and `fused`;
- `fused`: small fused ops of the Qwen3.5 / Qwen3-Next CPU path;
- `triton_branches`: torch bodies for three CPU branches SGLang sends to Triton;
- `extend_attention`: suffix-only extend attention for the `torch_native` backend;
- `threads`: each rank's resolved cores applied with torch;
- `memory_profile`: the KV pool's budget charged with the loaded weights, not with the machine's RAM drop;
- `extra_buffer`: what SGLang's GPU-default `extra_buffer` strategy reads from a device;
- `mamba2`, `kda`: the Mamba2 mixer's and the KDA kernel module's kernel names bound to torch bodies (`ops/`);
- `mla`: MLA's dispatch on `torch_native`;
- `moe`: SGLang's CPU MoE fixes (routed-expert scale, squared-ReLU experts, Nemotron-H's router GEMM);
- `env`: every environment variable the port reads or sets.

Every SGLang change point is a row of `hooks.py`, registered by the plugin entry point `sglang_cpu_compat`.
"""
