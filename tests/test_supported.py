"""Fail closed: Tail-Replay refuses, naming the flag, any SGLang configuration it is not built and tested for, as
SGLang resolved it (after its own post-processing), and any SGLang release but the pinned one."""

import json

import re

import pytest

from tailreplay_sglang.supported import (DISAGGREGATED, SGLANG_VERSION, SUPPORTED, UnsupportedConfigError,
                                         check_resolved, check_version, unsupported)

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
    ("page_size", 128),
    ("disaggregation_mode", "encode"), ("enable_lora", True),
    ("lora_paths", ["adapter"]),
    ("speculative_algorithm", "EAGLE3"), ("speculative_algorithm", "DFLASH"), ("speculative_eagle_topk", 4),
    ("speculative_draft_model_path", "draft"), ("enable_int8_mamba_checkpoint", True),
    ("enable_streaming_session", True), ("moe_a2a_backend", "deepep"), ("pp_size", 2), ("enable_mixed_chunk", True),
    ("enable_unified_memory", True), ("enable_page_major_kv_layout", True),
    ("enable_mis", True), ("enable_torch_compile", True),
    ("enable_unified_cache_external_linker", True), ("enable_lmcache", True), ("hicache_storage_backend", "hf3fs"),
    ("hicache_host_memory_mode", "buffer_only"),
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
    fields = [*SUPPORTED, *(f for checks in DISAGGREGATED.values() for f in checks)]
    assert [f for f in fields if not hasattr(server_args, f)] == []


# ---- PD disaggregation (issue 50): what each role supports beyond SUPPORTED ----

@pytest.mark.parametrize("mode, changes, refused", [
    ("prefill", {}, None),
    ("prefill", {"disaggregation_transfer_backend": "mooncake_tcp"}, None),
    ("decode", {"disable_radix_cache": True}, None),  # a decode server without its radix cache
    ("decode", {}, None),  # with --disaggregation-decode-enable-radix-cache
    ("prefill", {"disaggregation_transfer_backend": "nixl"}, "--disaggregation-transfer-backend"),
    ("decode", {"disaggregation_transfer_backend": "fake"}, "--disaggregation-transfer-backend"),
    ("prefill", {"enable_hierarchical_cache": True}, "--enable-hierarchical-cache"),
    ("decode", {"enable_hierarchical_cache": True}, "--enable-hierarchical-cache"),
    ("prefill", {"speculative_algorithm": "NEXTN"}, "--speculative-algorithm"),
    ("decode", {"disaggregation_decode_enable_offload_kvcache": True}, "--disaggregation-decode-enable-offload"),
    ("null", {"disaggregation_transfer_backend": "nixl"}, None),  # colocated: the transfer backend is unused
])
def test_pd_roles(server_args, mode, changes, refused):
    from types import SimpleNamespace

    fields = {f: getattr(server_args, f) for f in [*SUPPORTED, *DISAGGREGATED["decode"], *DISAGGREGATED["prefill"]]}
    resolved = SimpleNamespace(**{**fields, "disaggregation_mode": mode, **changes})
    if refused is None:
        assert unsupported(resolved) == []
        return
    with pytest.raises(UnsupportedConfigError, match=refused):
        check_resolved(resolved)


def test_only_the_pinned_sglang_release():
    import sglang

    check_version(sglang.__version__)
    assert sglang.__version__ == SGLANG_VERSION
    with pytest.raises(UnsupportedConfigError, match="sglang==0.5.23"):
        check_version("0.5.24")


# ---- the linear-attention prefill the interval anchors are read from (issue 38 item 2) ----

def _launcher_fields(model_path, *flags) -> tuple[dict, object]:
    """What the launcher hands SGLang for these flags (`plugin.hand_off`), and the parsed arguments."""
    import argparse

    from tailreplay_sglang.plugin import add_cli_args, config_from_args, hand_off

    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path")
    parser.add_argument("--linear-attn-prefill-backend")
    add_cli_args(parser)
    args = parser.parse_args(["--model-path", str(model_path), "--enable-tail-replay", *flags])
    return hand_off(config_from_args(args), args), args


def _resolved_prefill(sglang_default: str, **fields) -> str:
    """SGLang's linear-attention backend resolution (`resolve_linear_attn_backends`) in a scheduler context built
    from these ServerArgs fields, given the per-GPU default its registry computed (`flashinfer_gdn_prefill_default`
    returns "flashinfer" on SM90 for Qwen3.5's 128-wide heads with an fp32 state pool)."""
    from sglang.srt.layers.attention.linear.utils import resolve_linear_attn_backends
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    with use_context(create_context(ServerArgs(model_path="dummy", **fields), role="scheduler")):
        return resolve_linear_attn_backends(prefill_default=sglang_default)


def test_interval_anchors_keep_sm90s_gdn_prefill_on_triton(tiny_qwen35):
    from tailreplay_sglang.families.gdn import FAMILY
    from tailreplay_sglang.supported import check_anchor_prefill

    fields, _ = _launcher_fields(tiny_qwen35)
    assert fields["linear_attn_prefill_backend"] == "triton"
    pinned = _resolved_prefill("flashinfer", linear_attn_prefill_backend=fields["linear_attn_prefill_backend"])
    assert pinned.prefill.value == "triton"
    check_anchor_prefill(FAMILY, pinned)
    # without the pin SGLang's SM90 default wins, and the scheduler's check refuses it before any anchor is planned
    unpinned = _resolved_prefill("flashinfer")
    assert unpinned.prefill.value == "flashinfer"
    with pytest.raises(UnsupportedConfigError, match=r"--linear-attn-prefill-backend \(resolved 'flashinfer'"):
        check_anchor_prefill(FAMILY, unpinned)


def test_no_interval_anchors_leave_the_prefill_backend_to_sglang(tiny_qwen35):
    assert "linear_attn_prefill_backend" not in _launcher_fields(tiny_qwen35, "--tail-replay-anchor-interval", "0")[0]
    assert "linear_attn_prefill_backend" not in _launcher_fields(tiny_qwen35, "--tail-replay-exact-budget", "0")[0]
    fields, _ = _launcher_fields(tiny_qwen35, "--tail-replay-anchor-interval", "0",
                                 "--linear-attn-prefill-backend", "flashinfer")
    assert "linear_attn_prefill_backend" not in fields


def test_a_chosen_prefill_backend_without_anchor_states_is_refused_naming_the_flag(tiny_qwen35, tiny_kimi_linear):
    from tailreplay_sglang.config import TailReplayConfigError

    for model in (tiny_qwen35, tiny_kimi_linear):
        with pytest.raises(TailReplayConfigError, match="--linear-attn-prefill-backend flashinfer: .*interval "
                                                        "anchors .*--tail-replay-anchor-interval 0"):
            _launcher_fields(model, "--linear-attn-prefill-backend", "flashinfer")
    fields, _ = _launcher_fields(tiny_qwen35, "--linear-attn-prefill-backend", "triton")
    assert "linear_attn_prefill_backend" not in fields  # the user's own triton stands


def test_mamba2_anchors_do_not_depend_on_the_linear_attention_backend(tiny_nemotron_h):
    from tailreplay_sglang.families.mamba2 import FAMILY
    from tailreplay_sglang.supported import check_anchor_prefill

    _launcher_fields(tiny_nemotron_h, "--linear-attn-prefill-backend", "flashinfer")  # accepted
    check_anchor_prefill(FAMILY, _resolved_prefill("flashinfer"))


# ---- the host hidden tier and CUDA graphs, as SGLang resolves them (issue 38 F8) ----

def _resolved_graphs(**flags):
    from sglang.srt.arg_groups.cuda_graph_hook import parse_cuda_graph_config
    from sglang.srt.runtime_context import create_context, get_exec, use_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", **flags)
    parse_cuda_graph_config(server_args)  # the launcher's resolution (skipped for a CPU device)
    with use_context(create_context(server_args, role="scheduler")):
        return get_exec().graph.cuda_graph_config


@pytest.mark.parametrize("flags, rows", [
    ({"disable_cuda_graph": True}, 0),
    ({"disable_decode_cuda_graph": True, "disable_prefill_cuda_graph": True}, 0),
    ({"disable_cuda_graph": True, "cuda_graph_backend_prefill": "breakable"}, "prefill"),
    ({}, "largest"),
], ids=["legacy-off", "per-phase-off", "prefill-re-enabled", "defaults"])
def test_the_host_tier_stages_what_the_largest_resolved_graph_writes(flags, rows):
    """Issue 63 item 2: the host tier runs under CUDA graphs (no refusal), its staging area sized from SGLang's
    resolved graph config: none with every phase eager, else the largest decode batch times its tokens per
    request (2: a verify's draft tokens) or the largest prefill token bucket, whichever is more."""
    from tailreplay_sglang.lifecycle import staging_rows_for

    graphs = _resolved_graphs(**flags)
    if rows:
        with pytest.raises(ValueError, match="no batch sizes to size the host tier's staging"):
            staging_rows_for(graphs, decode_tokens_per_req=2)  # the launcher's config: buckets come later
    graphs.decode.bs, graphs.prefill.bs = [1, 2, 4, 160], [256, 512]  # the buckets the scheduler resolves
    expected = {0: 0, "prefill": 512, "largest": 320}[rows]
    assert staging_rows_for(graphs, decode_tokens_per_req=2) == expected


@pytest.mark.parametrize("family, flags, refused", [
    ("gdn", {}, None),  # SGLang's default on a GPU: the breakable prefill graph runs the GDN extend eagerly
    ("gdn", {"cuda_graph_backend_prefill": "full"}, "full"),
    ("kda", {"cuda_graph_backend_prefill": "breakable"}, "breakable"),
    ("kda", {"cuda_graph_backend_prefill": "full"}, "full"),
    ("kda", {"disable_prefill_cuda_graph": True}, None),
], ids=["gdn-default", "gdn-full", "kda-breakable", "kda-full", "kda-off"])
def test_no_prefill_graph_captures_the_extend_interval_anchors_are_written_in(family, flags, refused):
    """GPU path review N4: a captured linear extend never runs the anchor hooks at replay."""
    from tailreplay_sglang.supported import check_anchor_graphs

    graphs = _resolved_graphs(**flags)
    check_anchor_graphs(_family(family), graphs, on_cuda=False)  # no graphs on a CPU
    if refused is None:
        check_anchor_graphs(_family(family), graphs, on_cuda=True)
    else:
        with pytest.raises(UnsupportedConfigError, match=f"--cuda-graph-backend-prefill {refused} captures"):
            check_anchor_graphs(_family(family), graphs, on_cuda=True)


def _family(name: str):
    """The family's own instance: what differs between families is an attribute of `Family`, not a name test."""
    import importlib

    from tailreplay_sglang.families import MODULES

    return importlib.import_module(MODULES[name]).FAMILY


# ---- speculative decoding only on the families it is tested on (issue 40) ----


@pytest.mark.parametrize("family, algorithm, refused", [
    ("gdn", "NEXTN", False), ("gdn", "NGRAM", False), ("gdn_hc", "NEXTN", False), ("kda", "NEXTN", False),
    ("mamba2", "NEXTN", True), ("lightning", "NGRAM", True), ("kda_attn_res", "NEXTN", True),
    ("kda_mhc", "NEXTN", False), ("mamba2", None, False)])
def test_speculative_decoding_only_on_tested_families(family, algorithm, refused):
    from types import SimpleNamespace

    from tailreplay_sglang.supported import check_speculative_family

    call = lambda: check_speculative_family(_family(family),  # noqa: E731
                                            SimpleNamespace(speculative_algorithm=algorithm))
    if refused:
        with pytest.raises(UnsupportedConfigError, match="--speculative-algorithm"):
            call()
    else:
        call()


@pytest.mark.parametrize("family, attn_dp, refused", [
    ("gdn", 2, False), ("mamba2", 2, True), ("kda", 2, True), ("mamba2", 1, False), ("kda", 1, False)])
def test_dp_attention_only_on_families_whose_replay_runs_under_it(family, attn_dp, refused):
    """Attention DP needs the family's replay to run its feed-forward blocks as one pass of every rank: GDN only."""
    from types import SimpleNamespace

    from tailreplay_sglang.supported import check_dp_attention_family

    call = lambda: check_dp_attention_family(_family(family), SimpleNamespace(attn_dp_size=attn_dp))  # noqa: E731
    if refused:
        with pytest.raises(UnsupportedConfigError, match="--enable-dp-attention .* GDN models"):
            call()
    else:
        call()


# ---- the namespace of a Tail-Replay server's pages in a shared Mooncake store (cache/storage_key.py) ----

MOONCAKE_L3 = ("--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake")


def _storage_config(model_path, *flags) -> dict:
    import argparse

    from tailreplay_sglang.plugin import add_cli_args, config_from_args, hand_off

    parser = argparse.ArgumentParser()
    for flag in ("--model-path", "--dtype", "--hicache-storage-backend", "--hicache-storage-backend-extra-config",
                 "--kv-cache-dtype", "--revision", "--page-size"):
        parser.add_argument(flag)
    parser.add_argument("--enable-hierarchical-cache", action="store_true")
    add_cli_args(parser)
    args = parser.parse_args(["--model-path", str(model_path), "--enable-tail-replay", *flags])
    fields = hand_off(config_from_args(args), args)
    return json.loads(fields.get("hicache_storage_backend_extra_config", "{}"))


def test_mooncake_pages_are_tagged_with_what_they_hold(tiny_qwen35, tiny_qwen3next, tmp_path):
    """Servers agreeing on the checkpoint and the dtypes of their pages share a tag; another `--dtype`, hidden
    dtype or checkpoint gets another; the user's own extra config keeps its keys and its tag goes in front; `file`
    (which ignores tags) and a server without L3 are left alone."""
    same = _storage_config(tiny_qwen35, *MOONCAKE_L3, "--dtype", "float32")
    assert same == _storage_config(tiny_qwen35, *MOONCAKE_L3, "--dtype", "float32")
    tag = same["extra_backend_tag"]
    assert tag.startswith("tr2-")
    assert _storage_config(tiny_qwen35, *MOONCAKE_L3, "--dtype", "bfloat16")["extra_backend_tag"] != tag
    assert _storage_config(tiny_qwen35, *MOONCAKE_L3, "--dtype", "float32", "--tail-replay-hidden-dtype",
                           "bfloat16")["extra_backend_tag"] != tag
    assert _storage_config(tiny_qwen3next, *MOONCAKE_L3, "--dtype", "float32")["extra_backend_tag"] != tag
    user = {"master_server_address": "127.0.0.1:1", "protocol": "tcp", "extra_backend_tag": "team"}
    config_file = tmp_path / "mooncake.json"
    config_file.write_text(json.dumps(user))
    for given in (json.dumps(user), f"@{config_file}"):
        got = _storage_config(tiny_qwen35, *MOONCAKE_L3, "--dtype", "float32",
                              "--hicache-storage-backend-extra-config", given)
        assert got == {**user, "extra_backend_tag": f"team_{tag}"}
    file_tag = _storage_config(tiny_qwen35, "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                               "--dtype", "float32")  # `file` keys ignore it: the folder is claimed with it
    assert file_tag == {"extra_backend_tag": tag}
    assert _storage_config(tiny_qwen35) == {}


@pytest.mark.parametrize("flag, values", [
    ("--kv-cache-dtype", ("float32", "bfloat16", "float16")),  # bfloat16 and float16: same size, other bytes
    ("--revision", ("main", "v2")), ("--page-size", ("1", "16", "64"))])
def test_each_setting_that_changes_a_pages_bytes_changes_the_tag(tiny_qwen35, flag, values):
    """Issue 65 class 4: two servers whose KV dtypes have the same size (or another revision or page size) would
    read each other's pages as their own if the tag did not hash the setting."""
    tags = {_storage_config(tiny_qwen35, *MOONCAKE_L3, "--dtype", "float32", flag, value)["extra_backend_tag"]
            for value in values}
    assert len(tags) == len(values)


def test_the_tag_names_the_weights_not_only_the_config(tiny_qwen35, tmp_path):
    """Review F7: a fine-tune served with its base's config gets pages of its own."""
    import shutil

    tune = tmp_path / "tune"
    shutil.copytree(tiny_qwen35, tune)
    weights = next(tune.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8) if data[-8:] != bytes(8) else b"\x01" * 8  # other values in the last tensor
    weights.write_bytes(bytes(data))
    base = _storage_config(tiny_qwen35, *MOONCAKE_L3, "--dtype", "float32")["extra_backend_tag"]
    assert _storage_config(tune, *MOONCAKE_L3, "--dtype", "float32")["extra_backend_tag"] != base


def test_a_file_folder_is_claimed_by_the_first_tag_and_refused_to_another(tmp_path):
    """Review F7: the `file` backend keys its files by model path only, so a server whose pages hold another layout
    is refused at start-up, naming the folder; servers of one tag share it."""
    from tailreplay_sglang.cache.storage_key import StorageFolderTagError, claim_file_folder

    folder = tmp_path / "l3"
    claim_file_folder(folder, "tr2-aaa_s-1")
    claim_file_folder(folder, "tr2-aaa_s-1")  # a second server (or TP rank) of the same tag
    with pytest.raises(StorageFolderTagError, match=f"{folder} holds pages tagged tr2-aaa_s-1, this server's are "
                                                    f"tr2-aaa_s-2"):
        claim_file_folder(folder, "tr2-aaa_s-2")
    assert [p.name for p in folder.iterdir()] == ["tail_replay_storage_tag"]  # no staged file left behind


def test_stored_states_are_tagged_with_their_layout():
    """The scheduler's part of the tag (`storage_key.state_tag`, added to the launcher's): the per-slot shape and
    dtype of the mamba pool's conv and SSM parts, whatever the pool's number of slots. The CPU flags' conv states
    (bfloat16) and extra_buffer's (the model's float32) get different tags."""
    from types import SimpleNamespace

    import torch

    from tailreplay_sglang.cache.storage_key import state_tag

    def pool(slots: int, conv_dtype, ssm_dtype=torch.float32):
        return SimpleNamespace(conv=[torch.zeros(3, slots, 96, 3, dtype=conv_dtype)],
                               temporal=torch.zeros(3, slots, 4, 16, 16, dtype=ssm_dtype))

    tag = state_tag(pool(8, torch.float32))
    assert tag.startswith("s-") and tag == state_tag(pool(64, torch.float32))
    assert len({tag, state_tag(pool(8, torch.bfloat16)), state_tag(pool(8, torch.float16)),
                state_tag(pool(8, torch.float32, torch.bfloat16))}) == 4


# ---- what the row exchange needs under attention DP (multi-server review F3, F4) ----


@pytest.mark.parametrize("changes, skip_all_gather, mask_pad, refused", [
    ({}, False, False, None),
    ({}, True, False, "SGLANG_SCHEDULER_SKIP_ALL_GATHER"),
    ({"quantization": "modelopt_fp4", "moe_runner_backend": "flashinfer_cutlass"}, False, False,
     "--disable-flashinfer-cutlass-moe-fp4-allgather"),
    ({"quantization": "modelopt_fp4", "moe_runner_backend": "flashinfer_cutlass",
      "disable_flashinfer_cutlass_moe_fp4_allgather": True}, False, False, None),
    ({}, False, True, "SGLANG_OPT_MASK_DP_PAD_MOE"),
    ({"speculative_algorithm": "EAGLE"}, False, False, "--speculative-algorithm EAGLE"),
], ids=["plain", "skip-all-gather", "fp4-all-gather", "fp4-all-gather-off", "mask-dp-pad", "nextn"])
def test_attention_dp_refuses_what_breaks_the_row_exchange_by_name(changes, skip_all_gather, mask_pad, refused):
    """Each of these is accepted by SGLang with attention DP and, with Tail-Replay, would hang a replaying rank in
    the exchange or feed its MoE the wrong rows; without attention DP none of them matters to the replay."""
    from types import SimpleNamespace

    from tailreplay_sglang.supported import check_dp_attention_exchange

    args = SimpleNamespace(**{"attn_dp_size": 2, "dwdp_size": 1, "quantization": None, "moe_runner_backend": "auto",
                              "disable_flashinfer_cutlass_moe_fp4_allgather": False, "speculative_algorithm": None,
                              **changes})
    check_dp_attention_exchange(SimpleNamespace(**{**vars(args), "attn_dp_size": 1}), skip_all_gather, mask_pad)
    if refused is None:
        check_dp_attention_exchange(args, skip_all_gather, mask_pad)
    else:
        with pytest.raises(UnsupportedConfigError, match=f"--enable-dp-attention .*{re.escape(refused)}"):
            check_dp_attention_exchange(args, skip_all_gather, mask_pad)


def test_a_resolved_dwdp_server_is_refused_under_attention_dp():
    """`--dwdp-size` as SGLang's ServerArgs holds it: refused whatever attention DP size it shows yet (SGLang sets
    attention DP and EP from it while it launches)."""
    from sglang.srt.server_args import ServerArgs

    from tailreplay_sglang.supported import check_dp_attention_exchange

    try:
        args = ServerArgs(model_path="dummy", tp_size=2, dwdp_size=2, enable_dp_attention=True, dp_size=2)
    except Exception as e:  # SGLang's own validation of DWDP on this machine
        pytest.skip(f"SGLang refuses the DWDP configuration itself here: {e}")
    assert args.dwdp_size == 2
    with pytest.raises(UnsupportedConfigError, match="--dwdp-size 2 .* ranks that skip forwards"):
        check_dp_attention_exchange(args, skip_all_gather=False, mask_dp_pad_moe=False)


def test_draft_forwards_take_no_part_in_the_replay(monkeypatch):
    """Review C/F4: the hooked copy-on-write runs for the draft runner too; its forwards replay nothing (the MTP
    layers keep no recurrent state) and so never enter the row exchange."""
    from types import SimpleNamespace

    from tailreplay_sglang import lifecycle, replay

    ran = []
    monkeypatch.setattr(replay, "run_pending", lambda *a, **k: ran.append(a))
    runtime = SimpleNamespace(store=object(), staged_anchors=SimpleNamespace(restore_host=lambda *a: ran.append(a)),
                              interval_anchors=None, host_anchors=None, family=None, pending=None, config=None,
                              metrics=None, replay_in_step=True)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True))
    draft = SimpleNamespace(device="cpu", is_draft_worker=True, req_to_token_pool=None)
    assert lifecycle.replay_after_clear(runtime, "result", draft, batch) == "result" and ran == []
    target = SimpleNamespace(device="cpu", is_draft_worker=False, req_to_token_pool=None)
    lifecycle.replay_after_clear(runtime, "result", target, batch)
    assert len(ran) == 2  # the target's host restores and its replay pass


def test_a_hicache_scheduler_claims_its_file_folder_with_its_state_layout(tmp_path, monkeypatch):
    """The scheduler's side of F7 (`TailReplayRadixCache._tag_state_layout`): the launcher's tag plus its states'
    layout claims the `file` folder; a server whose states are laid out otherwise is refused there."""
    from types import SimpleNamespace

    import sglang.srt.runtime_context as runtime_context
    import torch

    from tailreplay_sglang.cache.hierarchy import TailReplayRadixCache
    from tailreplay_sglang.cache.storage_key import StorageFolderTagError

    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    extra = json.dumps({"file_storage_path": str(tmp_path / "l3"), "extra_backend_tag": "tr2-abc"})
    monkeypatch.setattr(runtime_context, "get_memory", lambda: SimpleNamespace(
        hicache_storage_backend="file", hicache_storage_backend_extra_config=extra))

    def scheduler(conv_dtype):
        cache = SimpleNamespace(conv=[torch.zeros(3, 4, 96, 3, dtype=conv_dtype)], temporal=torch.zeros(3, 4, 2, 2))
        params = SimpleNamespace(req_to_token_pool=SimpleNamespace(mamba_pool=SimpleNamespace(mamba_cache=cache)))
        return SimpleNamespace(runtime=SimpleNamespace(store=object())), params

    TailReplayRadixCache._tag_state_layout(*scheduler(torch.float32))
    assert (tmp_path / "l3" / "tail_replay_storage_tag").read_text().startswith("tr2-abc_s-")
    TailReplayRadixCache._tag_state_layout(*scheduler(torch.float32))
    with pytest.raises(StorageFolderTagError, match="holds pages tagged tr2-abc_s-"):
        TailReplayRadixCache._tag_state_layout(*scheduler(torch.bfloat16))
