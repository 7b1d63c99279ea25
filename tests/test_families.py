"""The recurrent families (`tailreplay_sglang/families/`): the registry, and `bind`'s start-up check of every model
internal the capture and replay touch, in isolation and on a real server whose model lacks one."""

from types import SimpleNamespace

import pytest

from helpers import FAULT_PLUGIN_DIR
from tailreplay_eval.server import ServerProcess
from tailreplay_sglang.families import MODULES, FamilyBindError, family_for
from tailreplay_sglang.layout import FULL, GDN, KDA, LINEAR, MAMBA2, HybridLayout

LAYOUT = (LINEAR, LINEAR, FULL, LINEAR)


@pytest.mark.parametrize("mixer", sorted(MODULES))
def test_every_layout_mixer_has_a_family_that_names_what_a_bare_model_lacks(mixer):
    layout = HybridLayout(LAYOUT, 8, mixer=mixer, chunk_size=64 if mixer == MAMBA2 else None)
    family = family_for(layout)
    assert family.name == mixer
    bare = SimpleNamespace(layers=[SimpleNamespace() for _ in LAYOUT], config=SimpleNamespace())
    with pytest.raises(FamilyBindError, match=rf"Tail-Replay \({mixer}\): .*model\.layers\[3\]\.") as error:
        family.bind(bare, layout)
    assert "model.layers[2]" not in str(error.value)  # the attention layer is never replayed


def test_only_mamba2_keeps_no_anchor_at_a_replayed_match_end_and_has_its_own_grid():
    grids = {}
    for mixer in (GDN, KDA, MAMBA2):
        layout = HybridLayout(LAYOUT, 8, mixer=mixer, chunk_size=256 if mixer == MAMBA2 else None)
        family = family_for(layout)
        grids[mixer] = (family.anchor_at_replay_end, family.anchor_grid(layout))
    assert grids == {GDN: (True, 64), KDA: (True, 64), MAMBA2: (False, 256)}


@pytest.mark.server
def test_a_model_internal_the_replay_needs_missing_stops_the_server_at_start_up(tiny_qwen35, tmp_path):
    """As an SGLang rename would: the scheduler stops before serving, naming what is missing, instead of failing
    at the first hit."""
    env = {"PYTHONPATH": str(FAULT_PLUGIN_DIR),
           "TAILREPLAY_FAULT_DROP_MODEL_ATTR": "linear_attn.fix_query_key_value_ordering"}
    server = ServerProcess(str(tiny_qwen35), ("--enable-tail-replay",), log_path=tmp_path / "server.log", env=env)
    try:
        with pytest.raises(RuntimeError, match="during start-up"):
            server.start().wait_healthy(timeout=240)
    finally:
        server.stop()
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "Tail-Replay (gdn): this SGLang's model lacks what the replay uses" in log
    assert "linear_attn.fix_query_key_value_ordering" in log
