"""Fail closed: Tail-Replay refuses, naming the flag, any SGLang configuration it is not built and tested for, as
SGLang resolved it (after its own post-processing), and any SGLang release but the pinned one."""

import pytest

from tailreplay_sglang.supported import (SGLANG_VERSION, SUPPORTED, UnsupportedConfigError, check_resolved,
                                         check_version, unsupported)

# What the CPU route runs (tailreplay_eval/server.py: CPU_FLAGS), as SGLang resolves it: the tested configuration
TESTED = {"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True, "page_size": 1}
# SGLang's GPU default, also tested (tests/test_production_path.py): extra_buffer with the overlap scheduler ("auto" is
# what the scheduler's ServerArgs still says; SGLang resolves it to extra_buffer there)
GPU_DEFAULT = [{"mamba_radix_cache_strategy": s, "disable_overlap_schedule": False} for s in ("auto", "extra_buffer")]


@pytest.fixture(scope="module")
def server_args():
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path="dummy", **TESTED)


def test_the_tested_configuration_passes(server_args):
    assert unsupported(server_args) == []
    check_resolved(server_args)


@pytest.mark.parametrize("scheduling", GPU_DEFAULT, ids=lambda s: s["mamba_radix_cache_strategy"])
def test_sglangs_gpu_default_scheduling_passes(server_args, scheduling):
    from types import SimpleNamespace

    assert unsupported(SimpleNamespace(**{**{f: getattr(server_args, f) for f in SUPPORTED}, **scheduling})) == []


@pytest.mark.parametrize("field, value", [
    ("mamba_radix_cache_strategy", "extra_buffer_lazy"), ("page_size", 128),
    ("enable_dp_attention", True), ("attn_dp_size", 2), ("disaggregation_mode", "decode"), ("enable_lora", True),
    ("lora_paths", ["adapter"]), ("speculative_algorithm", "EAGLE"), ("enable_int8_mamba_checkpoint", True),
    ("enable_streaming_session", True), ("moe_a2a_backend", "deepep"), ("pp_size", 2), ("enable_mixed_chunk", True),
    ("ep_size", 2), ("moe_dp_size", 2), ("enable_unified_memory", True), ("enable_page_major_kv_layout", True),
    ("enable_unified_cache_external_linker", True), ("enable_lmcache", True), ("hicache_storage_backend", "file"),
    ("enable_pdmux", True), ("enable_linear_replayssm", True), ("enable_linear_replayssm_spec", True),
    ("mamba_max_states_per_path", 4),
])
def test_each_unsupported_value_is_refused_naming_its_flag(server_args, field, value):
    from types import SimpleNamespace

    resolved = SimpleNamespace(**{**{f: getattr(server_args, f) for f in SUPPORTED}, field: value})
    flag = SUPPORTED[field][1]
    with pytest.raises(UnsupportedConfigError, match=flag.split()[0]):
        check_resolved(resolved)
    assert len(unsupported(resolved)) == 1


def test_every_checked_field_exists_in_sglangs_server_args(server_args):
    assert [f for f in SUPPORTED if not hasattr(server_args, f)] == []


def test_only_the_pinned_sglang_release():
    import sglang

    check_version(sglang.__version__)
    assert sglang.__version__ == SGLANG_VERSION
    with pytest.raises(UnsupportedConfigError, match="sglang==0.5.23"):
        check_version("0.5.24")
