"""Every environment variable the CPU port reads or sets, so that no other module of it touches the environment."""

import os

CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"  # SGLang's own switch to its CPU engine (`is_cpu()` wants "1")
DISABLE_CPU_FALLBACK_ENV = "TAILREPLAY_DISABLE_CPU_FALLBACK"
GLIBC_MALLOC_ENV = "TAILREPLAY_CPU_GLIBC_MALLOC"  # "default": glibc's own policy, not allocator.py's
MAMBA_CONV_DTYPE_ENV = "SGLANG_MAMBA_CONV_DTYPE"  # SGLang's conv-state dtype (default bfloat16), read at pool build
# mHC's pre and post (GLM-5.3-Flash): TileLang kernels unless these are 0, then SGLang's own torch paths
MHC_TILELANG_ENVS = ("SGLANG_OPT_USE_TILELANG_MHC_PRE", "SGLANG_OPT_USE_TILELANG_MHC_POST")


def cpu_engine_requested() -> bool:
    """SGLang's own switch to its CPU engine, read as `sglang.srt.utils.is_cpu` reads it."""
    return os.environ.get(CPU_ENGINE_ENV, "0") == "1"


def cpu_fallback_disabled() -> bool:
    return os.environ.get(DISABLE_CPU_FALLBACK_ENV) == "1"


def keep_glibc_malloc_defaults() -> bool:
    return os.environ.get(GLIBC_MALLOC_ENV) == "default"


def default_mamba_conv_dtype(dtype_name: str) -> None:
    """Make `dtype_name` SGLang's conv-state dtype unless the user chose one (extra_buffer.py says why)."""
    os.environ.setdefault(MAMBA_CONV_DTYPE_ENV, dtype_name)


def default_mhc_torch_paths() -> None:
    """mHC's pre and post on SGLang's torch paths unless the user chose otherwise (read per call and at model build)."""
    for name in MHC_TILELANG_ENVS:
        os.environ.setdefault(name, "0")
