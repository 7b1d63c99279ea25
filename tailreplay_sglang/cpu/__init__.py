"""What SGLang 0.5.23 lacks to serve hybrid GDN models on a CPU without sgl-kernel (CPU engine only).

- `fallback`: the import hook (installed by a .pth file, inert unless `SGLANG_USE_CPU_ENGINE=1`) that serves
  `sgl_kernel` from `sgl_kernel_shim` and stubs `torchvision` where the real packages are missing;
- `sgl_kernel_shim`: sgl-kernel's CPU entry points on the torch ops of `tailreplay_sglang.ops` and `fused`;
- `fused`: small fused ops of the Qwen3.5 / Qwen3-Next CPU path;
- `triton_branches`: torch bodies for three CPU branches SGLang sends to Triton;
- `extend_attention`: suffix-only extend attention for the `torch_native` backend;
- `threads`: each rank's resolved cores applied with torch.

Every SGLang hook these need is registered in `tailreplay_sglang/hooks.py`.
"""
