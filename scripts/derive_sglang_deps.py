"""Derive SGLang's non-CUDA runtime dependencies from its own wheel metadata.

SGLang's wheel pins a CUDA torch and GPU kernel packages. On a CPU-only machine we keep our CPU torch and
skip everything that only exists for GPUs; the rest of `Requires-Dist` is what SGLang needs to import and serve.

    python scripts/derive_sglang_deps.py path/to/sglang-0.5.23-*.whl > requirements/sglang-cpu.in

`scripts/setup_cpu.sh --refresh-lock` runs this and then pins the result (`requirements/sglang-cpu.lock`).
"""

import sys
import zipfile

from packaging.markers import default_environment
from packaging.requirements import Requirement

# torch and its companions come from our own CPU pin; these packages are CUDA/GPU-only builds.
SKIP = {
    "torch", "torchaudio", "torchvision", "torchcodec", "timm",
    "sglang-kernel", "flashinfer-python", "flash-attn-4", "cuda-python", "tilelang",
    "quack-kernels", "humming-kernels", "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla",
    "nvshmem4py-cu13", "torch-memory-saver", "nvidia-cutlass-dsl", "nvidia-mathdx", "nvidia-ml-py",
    "deepseek-recipe",
}


def normalize(name: str) -> str:
    return name.lower().replace("_", "-")


def runtime_requirements(wheel_path: str) -> list[str]:
    with zipfile.ZipFile(wheel_path) as wheel:
        meta_name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = wheel.read(meta_name).decode()
    env = dict(default_environment(), extra="")
    kept = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # extras and other platforms
        if normalize(req.name) in SKIP or normalize(req.name).startswith("nvidia-"):
            continue
        req.marker = None
        kept.append(str(req))
    return kept


if __name__ == "__main__":
    print("\n".join(runtime_requirements(sys.argv[1])))
