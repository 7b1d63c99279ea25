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


def test_lfm2_capture_reads_the_keywords_its_decoder_layers_are_called_with():
    """LFM2 calls each decoder layer with keywords only (`layer(layer_id=i, positions=..., hidden_states=...,
    residual=..., forward_batch=...)`), so positional pre-hooks see nothing. Group 0's first layer writes the token
    ids, each stored group's first layer its `hidden_states` (the stream entering it), not `residual` (there the
    previous layer's input); an idle forward (no KV locations) writes nothing."""
    import torch

    from tailreplay_sglang import capture
    from tailreplay_sglang.layout import SHORT_CONV

    class Layer(torch.nn.Module):
        def forward(self, layer_id, positions, hidden_states, residual, forward_batch):
            return hidden_states + 1, hidden_states

    layout = HybridLayout(LAYOUT, 2, mixer=SHORT_CONV, conv_kernel=3)
    writes = []
    store = SimpleNamespace(layout=layout,
                            write_tokens=lambda loc, ids: writes.append(("tokens", loc.tolist(), ids.tolist())),
                            write_hidden=lambda layer, loc, h: writes.append((layer, loc.tolist(), h.tolist())))
    layers = [Layer() for _ in LAYOUT]
    handles = capture.at_layer_keyword_inputs(layers, store)
    batch = SimpleNamespace(out_cache_loc=torch.tensor([5, 6]), input_ids=torch.tensor([11, 12]))
    h, residual = torch.zeros(2, 2), None
    for i, layer in enumerate(layers):
        h, residual = layer(layer_id=i, positions=None, hidden_states=h, residual=residual, forward_batch=batch)
    assert writes == [("tokens", [5, 6], [11, 12]), (3, [5, 6], [[3.0, 3.0], [3.0, 3.0]])]
    writes.clear()
    idle = SimpleNamespace(out_cache_loc=None, input_ids=None)
    layers[3](layer_id=3, positions=None, hidden_states=h, residual=residual, forward_batch=idle)
    assert writes == []
    for handle in handles:
        handle.remove()
