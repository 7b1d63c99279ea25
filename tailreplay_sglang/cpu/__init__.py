"""Pure-torch bodies for the compiled ops SGLang needs to serve hybrid GDN models on a CPU without sgl-kernel.

- `gdn`, `conv`, `fused`: the ops; `naive`: float64 token-by-token references for tests.
- `fallback`: the import hook (installed by a .pth file) that serves `sgl_kernel` from `sgl_kernel_shim`.
- `plugin`: SGLang plugin entry point that routes three Triton-only CPU branches to torch.
"""
