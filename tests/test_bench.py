"""Smoke test of the benchmarks at a tiny size: bench/ttft.py and bench/workloads.py run against two real tiny
servers (stock and Tail-Replay, started once with the benchmarks' own harness and passed by --url), write JSON of
the expected structure, and Tail-Replay's hits cover exactly what was matchable."""

import json
import sys
from pathlib import Path

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import harness  # noqa: E402
import ttft  # noqa: E402
import workloads  # noqa: E402

pytestmark = pytest.mark.server

TR = "Tail-Replay r=0.05"


@pytest.fixture(scope="module")
def urls(tiny_qwen35, tmp_path_factory):
    configs = {"stock": ("--dtype", "float32"), TR: ("--dtype", "float32", "--enable-tail-replay")}
    log_stem = tmp_path_factory.mktemp("bench") / "bench"
    with harness.running_servers(tiny_qwen35, configs, log_stem, Console(), max_total_tokens=8192,
                                 context_length=4096) as procs:
        yield [arg for label, p in procs.items() for arg in ("--url", f"{label}={p.base_url}")]


def test_ttft_full_prefill_misses_and_tail_replay_hits_the_whole_prefix(urls, tiny_qwen35, tmp_path):
    out = tmp_path / "ttft.json"
    # No --model-path: the script asks the first server what it serves.
    ttft.main(["--lengths", "256", "--full-reps", "1", "--hit-reps", "1", "--out", str(out), *urls])
    data = json.loads(out.read_text())
    assert {"method", "servers", "memory", "summary", "warmup", "samples", "machine_before"} <= set(data)
    assert Path(data["model"]) == Path(tiny_qwen35)
    assert data["servers"][TR]["tail_replay"] and not data["servers"]["stock"]["tail_replay"]
    arms = {row["arm"]: row for row in data["summary"]}
    assert set(arms) == {"full prefill", "stock hit", f"{TR} hit"}
    assert arms["full prefill"]["cached_max"] == 0
    hit = arms[f"{TR} hit"]
    assert hit["cached_min"] == hit["cached_max"] == 256
    assert hit["replayed"] == 64  # clamp(ceil(0.05 * 256), min 64)
    assert hit["speedup_mean"] > 0 and "speedup_mean" in arms["stock hit"]
    assert {"fa_kv_bytes_per_token", "tail_replay_hidden_bytes_per_token", "mamba_slot"} <= set(data["memory"])
    assert out.with_suffix(".png").stat().st_size > 0


def test_workloads_tail_replay_caches_every_matchable_token(urls, tiny_qwen35, tmp_path):
    out = tmp_path / "workloads.json"
    shapes = ["shared system prompt, q=40", "identical resend", "concurrent on one prefix"]
    workloads.main(["--model-path", str(tiny_qwen35), "--scale", "0.05", "--burst", "3", "--shapes", *shapes,
                    "--out", str(out), *urls])
    data = json.loads(out.read_text())
    assert {"method", "memory", "results", "machine_before"} <= set(data)
    by = {(r["shape"], r["config"]): r for r in data["results"]}
    assert set(by) == {(s, c) for s in shapes for c in ("stock", TR)}
    for shape in shapes:
        tr, stock = by[shape, TR], by[shape, "stock"]
        assert tr["matchable"] > 0 and tr["cached"] == tr["matchable"], shape
        assert stock["requests"] == tr["requests"] and stock["matchable"] == tr["matchable"], shape
        assert all(r["ttft_s"] > 0 for r in tr["records"] + stock["records"])
    assert out.with_suffix(".png").stat().st_size > 0
