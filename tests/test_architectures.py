"""The allow-list (`tailreplay_sglang/architectures.py`): every hybrid architecture SGLang 0.5.23 registers is
either served by a listed family or refused at start-up naming itself, and docs/models.md's table says the same.

SGLang decides hybrid-ness by config class, not by architecture name, so the walk is built from its source: the
config classes `configs/hybrid_arch.py` imports (and their subclasses among SGLang's configs, and the
linear-attention registry's), the model modules whose source names one of them, and those modules' `EntryClass`.
That scan misses modules that reach their config indirectly; the table lists those by hand, and every name in the
table must be an architecture SGLang registers (or this package's OLMo-Hybrid).
"""

import ast
import inspect
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tailreplay_sglang.architectures import DRAFTS, REFUSED, SERVED, UnsupportedArchitectureError, family_of
from tailreplay_sglang.families import MODULES
from tailreplay_sglang.layout import HybridLayout

ROOT = Path(__file__).resolve().parents[1]
OURS = {"OlmoHybridForCausalLM"}  # registered with SGLang by this package (tailreplay_sglang/models/)
# Architectures the scan finds beside a hybrid in the same model module that are not hybrids themselves
NOT_HYBRID = {"MiniCPMForCausalLM", "MiniCPMV"}


def _sglang_srt() -> Path:
    import sglang

    return Path(sglang.__file__).parent / "srt"


def _hybrid_config_names() -> set[str]:
    import sglang.srt.configs as configs
    import sglang.srt.configs.gigachat35  # noqa: F401 (registers itself in the linear-attention registry)
    from sglang.srt.configs import linear_attn_model_registry as registry

    tree = ast.parse((_sglang_srt() / "configs" / "hybrid_arch.py").read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module == "sglang.srt.configs" for alias in node.names}
    bases = tuple(getattr(configs, n) for n in names)
    classes = {n: getattr(configs, n) for n in dir(configs) if inspect.isclass(getattr(configs, n))}
    names |= {n for n, cls in classes.items() if issubclass(cls, bases)}
    names |= {spec.config_class.__name__ for spec in registry._LINEAR_ATTN_MODEL_REGISTRY}
    return names | {"Glm5NextConfig"}  # hybrid_arch.glm5_next_config tests its model_type, not its class


def _entry_classes(module: Path) -> list[str]:
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EntryClass" for t in node.targets):
            values = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
            return [v.id for v in values if isinstance(v, ast.Name)]
    return []


@pytest.fixture(scope="module")
def sglang_architectures() -> dict[str, set[str]]:
    """{"all": every EntryClass of SGLang's model modules, "hybrid": those of modules naming a hybrid config}, read
    from source (some hybrid modules do not import on a CPU: Mamba's, Inkling's)."""
    names = _hybrid_config_names()
    every, hybrid = set(), set()
    for module in sorted((_sglang_srt() / "models").glob("*.py")):
        entries = _entry_classes(module)
        every |= set(entries)
        if any(re.search(rf"\b{n}\b", module.read_text()) for n in names):
            hybrid |= set(entries)
    return {"all": every, "hybrid": hybrid}


def test_every_hybrid_sglang_registers_is_in_the_table(sglang_architectures):
    missing = sglang_architectures["hybrid"] - NOT_HYBRID - set(SERVED) - set(REFUSED) - set(DRAFTS)
    assert not missing, f"hybrids SGLang 0.5.23 registers that the allow-list neither serves nor refuses: {missing}"
    unknown = (set(SERVED) | set(REFUSED) | set(DRAFTS)) - sglang_architectures["all"] - OURS
    assert not unknown, f"names in the allow-list that SGLang 0.5.23 does not register: {unknown}"
    assert not set(SERVED) & set(REFUSED)
    listed = sglang_architectures["hybrid"] | set(REFUSED) | set(SERVED)
    assert {"Qwen4ExpForConditionalGeneration", "Glm5NextForConditionalGeneration", "KimiK3ForConditionalGeneration",
            "BailingMoeV3ForCausalLM", "BailingMoeV2_5ForCausalLM"} <= listed


@pytest.mark.parametrize("arch", sorted(SERVED))
def test_a_served_architecture_gets_its_family(arch):
    assert family_of([arch]) == SERVED[arch][0]
    assert SERVED[arch][0] in MODULES


@pytest.mark.parametrize("arch", sorted(DRAFTS))
def test_an_mtp_draft_is_served_with_its_target(arch):
    assert family_of([arch]) == SERVED[DRAFTS[arch]][0]


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_every_other_hybrid_is_refused_naming_itself_its_reason_and_the_served_list(arch):
    with pytest.raises(UnsupportedArchitectureError) as refused:
        family_of([arch])
    message = str(refused.value)
    assert f"does not serve {arch}: {REFUSED[arch]}" in message
    assert all(served in message for served in SERVED)


def test_an_unknown_architecture_is_refused_by_name():
    with pytest.raises(UnsupportedArchitectureError, match="does not serve Qwen3ForCausalLM .*linear-attention"):
        family_of(["Qwen3ForCausalLM"])


def test_qwen38_reads_its_qsa_layers_as_attention_and_stores_every_stream(tmp_path):
    """Qwen3.8-Flash-Next, served (tests/test_qwen38.py): its indexed_attention layers cut the groups, and a stored
    row is all hc_count streams of a group's input."""
    text = {"hidden_size": 64, "num_hidden_layers": 8, "hc_count": 4,
            "layer_types": (["linear_attention"] * 3 + ["indexed_attention"]) * 2}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen4ExpForConditionalGeneration"],
                                                      "text_config": text, "vision_config": {}}))
    layout = HybridLayout.from_model_path(str(tmp_path))
    assert [g.layers for g in layout.groups] == [(0, 1, 2), (4, 5, 6)]
    assert layout.mixer == "gdn_hc" and layout.row_width == 4 * 64 and layout.stores_embeddings


GLM_TEXT = {"hidden_size": 64, "num_hidden_layers": 8, "hc_mult": 4, "mhc": True,
            "layer_types": (["linear_attention"] * 3 + ["indexed_attention"]) * 2}


def test_glm5_reads_its_indexed_mla_layers_as_attention_and_stores_every_stream(tmp_path):
    """GLM-5.3-Flash, served (tests/test_glm5.py; at 5674c68 it was read as one GDN group): its indexed_attention
    layers cut the groups and a stored row is all hc_mult mHC streams, read from config.json as from the config
    SGLang builds, whose linear_attn_config lists the KDA layers 0-indexed (Kimi Linear's are 1-indexed)."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Glm5NextForConditionalGeneration"],
                                                      "text_config": GLM_TEXT, "vision_config": {}}))
    runtime_text = SimpleNamespace(**dict(GLM_TEXT, model_type="glm5_next_text", linear_attn_config={
        "kda_layers": [0, 1, 2, 4, 5, 6], "full_attn_layers": [3, 7]}))
    runtime = SimpleNamespace(architectures=["Glm5NextForConditionalGeneration"], text_config=runtime_text,
                              vision_config=SimpleNamespace())
    for layout in (HybridLayout.from_model_path(str(tmp_path)), HybridLayout.from_hf_config(runtime)):
        assert [g.layers for g in layout.groups] == [(0, 1, 2), (4, 5, 6)]
        assert layout.mixer == "kda_mhc" and layout.row_width == 4 * 64 and layout.stores_embeddings


def test_glm5_without_mhc_is_refused_naming_it(tmp_path):
    """SGLang builds GLM-5.3-Flash with a plain residual where config.json omits mhc: not what the replay reads."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Glm5NextForConditionalGeneration"],
                                                      "text_config": dict(GLM_TEXT, mhc=False)}))
    with pytest.raises(ValueError, match="has mhc off"):
        HybridLayout.from_model_path(str(tmp_path))


def test_qwen38_per_layer_embeddings_on_a_non_gdn_layer_are_refused_naming_them(tmp_path):
    """PLE layers start groups (tests/test_qwen38_ple.py); one on a QSA layer (which transformers does not allow)
    would hold states no replay rebuilds."""
    text = {"hidden_size": 64, "num_hidden_layers": 4, "hc_count": 4, "ple_layer_ids": [1, 4],
            "layer_types": ["linear_attention"] * 3 + ["indexed_attention"]}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen4ExpForConditionalGeneration"],
                                                      "text_config": text}))
    with pytest.raises(ValueError, match=r"ple_layer_ids \[4\] are not GDN layers"):
        HybridLayout.from_model_path(str(tmp_path))


def _docs_table() -> dict[str, tuple[str, str]]:
    text = (ROOT / "docs" / "models.md").read_text().split("## Every hybrid SGLang 0.5.23 serves", 1)[1]
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \| ([^|]+) \|$", text.split("\n## ", 1)[0], flags=re.M)
    return {arch: (status.strip(), why.strip()) for arch, status, why in rows}


def test_docs_models_table_agrees_with_the_allow_list():
    table = _docs_table()
    assert set(table) == set(SERVED) | set(REFUSED) | set(DRAFTS)
    for arch, (family, what) in SERVED.items():
        assert table[arch] == ("served", f"{family}: {what}")
    for arch, target in DRAFTS.items():
        assert table[arch][0] == f"served as the draft of `{target}`"
    for arch, why in REFUSED.items():
        assert table[arch] == ("refused", why)


def test_readme_names_every_served_architecture_and_links_the_table():
    readme = (ROOT / "README.md").read_text()
    assert all(f"`{arch}`" in readme for arch in SERVED)
    assert "docs/models.md" in readme and "Every hybrid SGLang 0.5.23 serves" in readme
