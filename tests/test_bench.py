"""Smoke test of the benchmarks at a tiny size: bench/ttft.py, bench/workloads.py and bench/load.py's bench_serving
runs against two real tiny servers (the session's stock one and its Tail-Replay one on the plugin's defaults, passed by
--url) write JSON of the expected structure, and Tail-Replay's hits cover exactly what was matchable. (The
benchmarks' own way of starting servers, `harness.running_servers`, runs in tests/test_quality_bench.py.)"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from helpers import load_bench
from tailreplay_eval import bench_serving, harness, memory
from tailreplay_sglang.architectures import SERVED

load = load_bench("load")
profile_load = load_bench("profile_load")
ttft = load_bench("ttft")
workloads = load_bench("workloads")

TR = "Tail-Replay r=0.05"


@pytest.fixture(scope="module")
def urls(stock_qwen35_server, anchored_qwen35_server):
    """The session's stock server (float32, metrics, 8192-token pool, context 4096) and its Tail-Replay one on the
    same settings with the plugin's defaults (`--enable-tail-replay` alone), as `--url LABEL=URL` arguments."""
    servers = {"stock": stock_qwen35_server, TR: anchored_qwen35_server}
    for server in servers.values():
        harness.flush_cache(server.base_url)
    return [arg for label, p in servers.items() for arg in ("--url", f"{label}={p.base_url}")]


@pytest.mark.server
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
    # The server runs the defaults (anchored, N = 512): no state on the path, and 256 tokens are within the budget
    # max(64, 512), so the hit replays its whole prefix from the root's zero state, exactly.
    assert hit["replayed"] == 256 and hit["exact_share"] == 1.0
    assert hit["speedup_mean"] > 0 and "speedup_mean" in arms["stock hit"]
    assert {"fa_kv_bytes_per_token", "tail_replay_hidden_bytes_per_token", "mamba_slot"} <= set(data["memory"])
    assert out.with_suffix(".png").stat().st_size > 0
    # Told its flags (--url-flags), the same server is an anchored arm: mid-interval hits on fresh branches.
    out = tmp_path / "anchored.json"
    ttft.main(["--lengths", "512", "1024", "--full-reps", "1", "--hit-reps", "2", "--out", str(out), *urls,
               "--url-flags", f"{TR}=--enable-tail-replay --tail-replay-anchor-interval 512"])
    data = json.loads(out.read_text())
    assert data["servers"][TR]["mode"] == "anchored" and data["servers"][TR]["anchor_interval"] == 512
    rows = {row["length"]: row for row in data["summary"] if row["arm"] == f"{TR} hit"}
    for L, anchor in ((512, 0), (1024, 512)):  # m = L - 256 from the anchor at L - 512 (the root at 512)
        assert (rows[L]["n"], rows[L]["cached_min"], rows[L]["cached_max"]) == (2, L - 256, L - 256)
        assert rows[L]["replayed"] == 256 and rows[L]["exact_share"] == 1.0
        assert {s["tail_replay_anchor"] for s in data["samples"] if s["arm"] == f"{TR} hit" and s["length"] == L
                } <= {anchor, None}
    assert [p["cached_tokens"] for p in data["anchored_primes"]] == [0, 512, 0, 512]


# ---- bench/ttft.py and bench/pareto.py: the plan and the arithmetic, no server ----

LENGTHS = [2048, 4096, 8192, 16384]


def _ttft_servers(config: dict) -> dict:
    configs = ttft.server_configs([0.05, 0.1], ["--dtype", "float32"], [512, 1024], LENGTHS, 32, 10)
    return {label: {"url": f"http://x/{label}", "tail_replay": "--enable-tail-replay" in flags, "flags": flags,
                    **ttft.describe_server(config, flags, "--enable-tail-replay" in flags)}
            for label, flags in configs.items()}


def _ttft_sample(cached: int, replayed: int, exact, anchor, ttft_s: float = 1.0) -> dict:
    return {"prompt_tokens": cached + 32, "cached_tokens": cached, "tail_replay_tokens": replayed,
            "tail_replay_ms": 1.0, "tail_replay_exact": exact, "tail_replay_anchor": anchor,
            "tail_replay_state_survival": None, "ttft_s": ttft_s}


def test_ttft_paper_servers_and_anchored_arms_hit_mid_interval():
    _, config, _ = memory.resolve_model("quality-qwen35")
    servers = _ttft_servers(config)
    assert list(servers) == ["stock", "paper r=0.05", "paper r=0.10", "anchored N=512", "anchored N=1024"]
    paper, a512, a1024 = servers["paper r=0.05"], servers["anchored N=512"], servers["anchored N=1024"]
    # Paper mode is explicit now that the default is anchored.
    assert paper["flags"][-2:] == ("--tail-replay-exact-budget", "0") and paper["mode"] == "paper"
    assert (a512["mode"], a512["anchor_interval"], a1024["anchor_interval"]) == ("anchored", 512, 1024)
    # The anchored server's mamba pool holds every anchor: 64 from the warm prefixes at N=512 (4096-token chunks:
    # 7 interval anchors + 1 chunk end per chunk, + the request end), 3 per hit (the priming request's end, the
    # hit's end and its rebuilt state), the running requests.
    warm = sum(len(ttft.anchor_depths(L + 32, 512, 4096)) for L in LENGTHS)
    assert warm == 64 and memory._flag(list(a512["flags"]), "--max-mamba-cache-size") == str(64 + 120 + 8 + 16)
    assert ttft.anchor_depths(8192 + 32, 512, 4096)[-3:] == [7680, 8192, 8224]

    arms = {arm.name: arm for arm in ttft.make_arms(servers)}
    assert ttft.paper_reference(list(arms.values())).name == "paper r=0.05 hit"
    n512, n1024, r05 = arms["anchored N=512 hit"], arms["anchored N=1024 hit"], arms["paper r=0.05 hit"]
    for L in LENGTHS:
        # Anchored: m = L - N/2, anchor at L - N, N/2 replayed; paper: the whole prefix, clamp(ceil(r L), 64).
        assert (n512.matched(L), n512.expected_anchor(L), n512.expected_tail(config, L)) == (L - 256, L - 512, 256)
        assert (n1024.matched(L), n1024.expected_tail(config, L)) == (L - 512, 512)
        assert (r05.matched(L), r05.expected_tail(config, L)) == (L, max(64, -(-L // 20)))
        assert ttft.skip_reason(n512, L, 32, 4096) is None and ttft.skip_reason(n1024, L, 32, 4096) is None
    assert arms["stock hit"].expected_tail(config, 2048) is None and arms["stock hit"].matched(2048) == 2048
    # At L = N the anchor is the root's zero state (depth 0); below N, or off the interval grid, there is no anchor
    # at L - N: that length is skipped for the arm.
    assert ttft.skip_reason(n1024, 1024, 32, 4096) is None and n1024.expected_anchor(1024) == 0
    assert "no interval" in ttft.skip_reason(n1024, 512, 32, 4096)
    assert "not L - N" in ttft.skip_reason(n512, 3072 + 256, 32, 4096)
    assert ttft.plan_skips(list(arms.values()), [512, 2048], 32) == {
        ("anchored N=1024 hit", 512): ttft.skip_reason(n1024, 512, 32, 4096)}
    # Past the exact budget the hit would be approximate: refused when planning.
    tight = ttft.Arm("a", "a", "hit", True, (*a512["flags"], "--tail-replay-exact-budget", "128"), "anchored",
                     0.05, 512)
    with pytest.raises(ValueError, match="exact budget"):
        tight.expected_tail(config, 4096)


def test_ttft_check_fails_loudly_off_plan(monkeypatch):
    _, config, _ = memory.resolve_model("quality-qwen35")
    arms = {arm.name: arm for arm in ttft.make_arms(_ttft_servers(config))}
    n512, r05 = arms["anchored N=512 hit"], arms["paper r=0.05 hit"]
    ttft.check(n512, 8192, _ttft_sample(7936, 256, True, 7680), 256)
    ttft.check(r05, 8192, _ttft_sample(8192, 410, False, None), 410)
    for bad, match in ((_ttft_sample(8192, 256, True, 7680), "L - N/2 = 7936"),  # hit at L, not mid-interval
                       (_ttft_sample(7936, 410, False, None), "tail_replay_exact is False"),  # zero-init tail
                       (_ttft_sample(7936, 768, True, 7168), "expected N/2 = 256"),  # an older anchor
                       (_ttft_sample(7936, 256, None, None), "tail_replay_exact is None")):  # not reported
        with pytest.raises(RuntimeError, match=match):
            ttft.check(n512, 8192, bad, 256)
    with pytest.raises(RuntimeError, match="paper mode"):  # paper mode must not use an anchor
        ttft.check(r05, 8192, _ttft_sample(8192, 410, True, 7680), 410)
    with pytest.raises(RuntimeError, match="expected the whole prefix"):
        ttft.check(r05, 8192, _ttft_sample(7936, 410, False, None), 410)
    # Each anchored repetition primes a fresh branch off the anchor at L - N: P_L[:L - N] + N/2 + 32 new tokens.
    prefix, fresh = list(range(8192)), list(range(10**6, 10**6 + 256 + 32))
    cached = {"n": 7680}
    monkeypatch.setattr(ttft, "measure", lambda url, ids: _ttft_sample(cached["n"], 0, True, 7680))
    branch, primed = ttft.prime(n512, "http://x", prefix, 8192, fresh)
    assert branch[:n512.matched(8192)] == prefix[:7680] + fresh[:256] and primed["cached_tokens"] == 7680
    cached["n"] = 0
    with pytest.raises(RuntimeError, match="priming request cached 0 tokens, expected L - N = 7680"):
        ttft.prime(n512, "http://x", prefix, 8192, fresh)


def test_ttft_summary_compares_anchored_with_paper(tmp_path):
    _, config, _ = memory.resolve_model("quality-qwen35")
    arms = ttft.make_arms(_ttft_servers(config))
    times = {"full prefill": 10.0, "stock hit": 5.0, "paper r=0.05 hit": 1.0, "paper r=0.10 hit": 1.5,
             "anchored N=512 hit": 1.2, "anchored N=1024 hit": 1.4}
    samples = []
    for L in (4096, 8192):
        for arm in arms:
            m = arm.matched(L) if arm.kind == "hit" else 0
            replayed = arm.anchor_interval // 2 if arm.anchored else 0
            for rep in range(2):
                samples.append({"arm": arm.name, "server": arm.server, "length": L, "rep": rep,
                                **_ttft_sample(m, replayed, arm.anchored or None, None, times[arm.name])})
    rows = ttft.summarize(arms, [4096, 8192], samples)
    comparison = ttft.compare_with_paper(rows, arms)
    by = {(r["arm"], r["length"]): r for r in rows}
    a = by["anchored N=512 hit", 8192]
    assert (a["matched"], a["cached_min"], a["replayed"], a["exact_share"]) == (7936, 7936, 256, 1.0)
    assert a["speedup_mean"] == pytest.approx(10 / 1.2) and a["vs_paper_mean"] == pytest.approx(1.2)
    assert [(c["arm"], c["length"], c["within_target"]) for c in comparison] == [
        ("anchored N=512 hit", 4096, None), ("anchored N=1024 hit", 4096, None),
        ("anchored N=512 hit", 8192, True), ("anchored N=1024 hit", 8192, False)]  # 1.4x > 1.3x
    assert all(c["paper_arm"] == "paper r=0.05 hit" for c in comparison)
    ttft.print_table(rows, "t", Console(width=170), "paper r=0.05 hit")
    ttft.plot(rows, tmp_path / "ttft.png", "t")
    assert (tmp_path / "ttft.png").stat().st_size > 0


def _quality_json(tmp_path, drop: str | None = None, protocols=("context_first", "new_question")) -> Path:
    """A quality.py result as its summaries look: per mode and protocol, score and % per suite, mean replayed
    tokens, exact hits among the hits (new_question: the anchored modes' matches end mid-interval, less exact)."""
    base, tr = ["--dtype", "float32"], ["--enable-tail-replay", "--tail-replay-hidden-dtype", "float32"]
    flags = {"cache_off": [*base, "--disable-radix-cache"],
             "r0.05": [*base, *tr, "--tail-replay-ratio", "0.05", "--tail-replay-exact-budget", "0"],
             "anchored": [*base, *tr], "anchored_n1024": [*base, *tr, "--tail-replay-anchor-interval", "1024"],
             "full": [*base, *tr, "--tail-replay-mode", "full", "--tail-replay-exact-budget", "0"]}
    summary = {"cache_off": (0.5, 100.0, 0.0, 0), "r0.05": (0.25, 50.0, 240.0, 0),
               "anchored": (0.5, 100.0, 256.0, 10), "anchored_n1024": (0.45, 90.0, 512.0, 9),
               "full": (0.5, 100.0, 4785.0, 10)}
    modes = []
    for i, protocol in enumerate(protocols):
        for mode, (score, pct, replayed, exact) in summary.items():
            hits = 0 if mode == "cache_off" else 10
            exact = exact - 5 * i if mode.startswith("anchored") else exact
            entry = {"mode": mode, "protocol": protocol, "requests": 10, "replayed_mean": replayed + 100 * i,
                     "hits": hits, "exact_hits": exact, "exact_share": exact / hits if hits else None,
                     "ruler": {"score": score, "pct": pct - 10 * i if mode != "cache_off" else 100.0}}
            entry.pop(drop, None)
            modes.append(entry)
    path = tmp_path / "quality.json"
    path.write_text(json.dumps({"model": "quality-qwen35", "config": {"server_args": base},
                                "servers": {m: {"flags": f} for m, f in flags.items()}, "modes": modes}))
    return path


def test_pareto_points_bytes_quality_and_front(tmp_path):
    pareto = load_bench("pareto")

    acc = memory.account("quality-qwen35", ["--dtype", "float32", "--tail-replay-hidden-dtype", "float32"])
    paper = acc["fa_kv_bytes_per_token"] + acc["tail_replay_hidden_bytes_per_token"]
    slot = acc["mamba_slot"]["total_bytes"]
    out = tmp_path / "img" / "pareto.png"
    data = pareto.main(["--quality", str(_quality_json(tmp_path)), "--out", str(out)])
    assert data["protocols"] == ["context_first", "new_question"] and data["suite"] == "ruler"
    by = {(p["mode"], p["protocol"]): p for p in data["points"]}
    assert {m for m, _ in by} == {"r0.05", "anchored", "anchored_n1024", "full"} and len(by) == 8
    first = {m: p for (m, proto), p in by.items() if proto == "context_first"}
    assert [first[m]["kind"] for m in ("r0.05", "anchored", "anchored_n1024", "full")] == [
        "paper", "anchored", "anchored", "full"]
    # paper and full: KV + hiddens; anchored every N tokens: + one slot / N (the default N = 512).
    assert first["r0.05"]["bytes"] == first["full"]["bytes"] == paper
    assert first["anchored"]["anchor_interval"] == 512 and first["anchored"]["bytes"] == paper + slot / 512
    assert first["anchored_n1024"]["bytes"] == pytest.approx(paper + slot / 1024)
    a = first["anchored"]
    assert (a["pct"], a["replayed"], a["exact_share"]) == (100.0, 256.0, 1.0)
    b = by["anchored", "new_question"]
    assert (b["pct"], b["replayed"], b["exact_share"], b["bytes"]) == (90.0, 356.0, 0.5, a["bytes"])
    assert data["reference"] == {"context_first": 0.5, "new_question": 0.5}
    # Within a protocol each is best at something: r0.05 and full cost the fewest bytes (r0.05 replaying less,
    # full scoring more), anchored N=1024 fewer than N=512, which scores more and replays the least of the exact
    # modes; across protocols nothing is compared.
    assert all(p["pareto"] for p in data["points"])
    assert not pareto.dominates(first["anchored"], first["full"]) and pareto.dominates(
        {"bytes": 1, "pct": 100, "replayed": 0}, first["r0.05"])
    assert out.stat().st_size > 0
    written = json.loads(out.with_suffix(".json").read_text())
    assert [(p["mode"], p["protocol"]) for p in written["points"][:2]] == [("r0.05", "context_first"),
                                                                          ("anchored", "context_first")]
    one = pareto.main(["--quality", str(tmp_path / "quality.json"), "--out", str(tmp_path / "one.png"),
                       "--protocol", "new_question"])
    assert {p["protocol"] for p in one["points"]} == {"new_question"} and len(one["points"]) == 4


def test_pareto_missing_key_is_a_clear_error(tmp_path):
    pareto = load_bench("pareto")

    with pytest.raises(SystemExit, match=r"mode r0.05: no mean replayed tokens \(tried replayed_mean"):
        pareto.main(["--quality", str(_quality_json(tmp_path, drop="replayed_mean")),
                     "--out", str(tmp_path / "p.png")])
    result = json.loads(_quality_json(tmp_path).read_text())
    for entry in result["modes"]:
        entry["ruler"] = {"mean": 0.5} if entry["mode"] != "cache_off" else entry["ruler"]
    (tmp_path / "q2.json").write_text(json.dumps(result))
    with pytest.raises(SystemExit, match=r"mode r0.05: no score for ruler"):
        pareto.main(["--quality", str(tmp_path / "q2.json"), "--out", str(tmp_path / "p.png")])
    # The exact share is optional (the table shows '-'); exact hits over hits stand in for a missing share.
    data = pareto.points(json.loads(_quality_json(tmp_path, drop="exact_share").read_text()))
    assert {p["mode"]: p["exact_share"] for p in data["points"] if p["protocol"] == "new_question"} == {
        "r0.05": 0.0, "anchored": 0.5, "anchored_n1024": 0.4, "full": 1.0}
    result = json.loads(_quality_json(tmp_path, protocols=[None]).read_text())
    for entry in result["modes"]:
        for key in ("exact_share", "exact_hits", "hits", "protocol"):
            entry.pop(key)
    data = pareto.points(result)  # the older format: no protocol, no exact share
    assert data["protocols"] == [None] and all(p["exact_share"] is None for p in data["points"])
    with pytest.raises(pareto.QualityFormatError, match="no cache_off mode"):
        pareto.points({"model": "quality-qwen35", "modes": [{"mode": "full"}]})


@pytest.mark.server
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


@pytest.mark.server
def test_load_bench_serving_runs_report_hits_replays_and_latency(urls, tiny_qwen35, tmp_path):
    """bench/load.py's unit of work (tailreplay_eval/bench_serving.py), SGLang's own bench_serving from a flushed
    cache, against the stock and Tail-Replay servers: the shared-prefix dataset hits only on Tail-Replay (stock keeps
    no state where a system prompt ends), the server's replay counter moves, and the multi-turn chat set runs through
    the chat backend."""
    servers = {label: SimpleNamespace(base_url="http" + url) for label, _, url in (u.partition("=http")
                                                                                  for u in urls[1::2])}
    args = SimpleNamespace(groups=1, prompts_per_group=4, system_len=128, question_len=16, output_len=4, seed=0)
    runs = {label: bench_serving.summary(bench_serving.run(server, tiny_qwen35, "shared prefix", 8.0, args,
                                                           tmp_path / f"{i}.jsonl"))
            for i, (label, server) in enumerate(servers.items())}
    stock, tr = runs["stock"], runs[TR]
    for r in (stock, tr):
        assert r["completed"] == 4 and r["failed"] == 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["prompt_tokens"] > 4 * 128
    assert stock["cached_tokens"] == 0 and stock["replayed_tokens"] == 0
    assert tr["cached_tokens"] >= 3 * 120 and tr["replayed_tokens"] > 0  # 3 hits on the shared system prompt
    chat = bench_serving.summary(bench_serving.run(servers[TR], tiny_qwen35, "multi-turn", 8.0, args,
                                                   tmp_path / "c.jsonl"))
    assert chat["completed"] == 2 * 3 and chat["failed"] == 0 and chat["cached_tokens"] > 0


def test_load_equal_memory_charges_the_device_tier_store():
    """Equal device memory: the device-tier store is charged to each token, the host tier's is not."""
    cost = {name: memory.device_bytes_per_token("small", ["--dtype", "float32"], flags)
            for name, flags in load.SYSTEMS.items()}
    kv, hidden = (memory.account("small", ["--dtype", "float32"])[k]
                  for k in ("fa_kv_bytes_per_token", "tail_replay_hidden_bytes_per_token"))
    assert cost == {"stock": kv, "Tail-Replay device": kv + hidden, "Tail-Replay host": kv}


def test_profile_attributes_samples_to_the_innermost_plugin_module():
    """bench/profile_load.py's attribution of py-spy stacks: the innermost plugin frame decides; the CPU ops that
    stock runs too (the CPU port, sglang_cpu_compat, and tailreplay_sglang/ops/), SGLang's own frames and the stock
    functions the plugin's around-hooks wrap count for nobody; the hook's own lines count for it."""
    root, port = "/work/x/tailreplay_sglang", "/work/x/cpu_compat/sglang_cpu_compat"
    stacks = "\n".join([
        "run (sglang/scheduler.py:1);forward (sglang/model.py:2);_capture (" + root + "/capture.py:20);"
        f"_write ({root}/store/hidden_store.py:76) 3",
        f"run (sglang/scheduler.py:1);chunk_gated_delta_rule ({root}/ops/gdn.py:130) 80",
        f"run (sglang/scheduler.py:1);causal_conv1d_fn_cpu ({port}/sgl_kernel_shim.py:45) 10",
        f"run (sglang/scheduler.py:1);run ({root}/replay.py:88);scan ({root}/ops/gdn.py:149) 5",
        "run (sglang/scheduler.py:1) 2",
        f"run (sglang/scheduler.py:1);write_anchor_ssm_states ({root}/families/gdn.py:101);"
        f"chunk_gated_delta_rule_cpu ({port}/sgl_kernel_shim.py:57) 7",
        f"run (sglang/scheduler.py:1);write_anchor_ssm_states ({root}/families/gdn.py:102);"
        f"IntervalAnchors.write_ssm_states ({root}/cache/anchors.py:111) 4",
        f"run (sglang/scheduler.py:1);write_anchor_conv_states ({root}/families/gdn.py:93) 1"])
    total, per_module = profile_load.attribute(stacks)
    assert total == 112
    assert per_module == {"tailreplay_sglang/store/hidden_store.py": 3, "tailreplay_sglang/replay.py": 5,
                          "tailreplay_sglang/cache/anchors.py": 4, "tailreplay_sglang/families/gdn.py": 1}


# ---- bench/memory.py (tailreplay_eval/memory.py): computed from configs, no server ----

def _sglang_slot_bytes(config: dict, n_gdn: int, tp: int = 1) -> int:
    """One mamba slot as SGLang 0.5.23 sizes it on one of `tp` attention-TP ranks: Qwen3NextConfig.mamba2_cache_params
    for GDN models,
    NemotronHConfig's / GraniteMoeHybridConfig's for Mamba2 ones (their names for the same shape), KimiLinearConfig's
    for Kimi Linear."""
    from sglang.srt.configs.mamba_utils import (KimiLinearCacheParams, KimiLinearStateShape, Mamba2CacheParams,
                                                Mamba2StateShape, mamba2_state_dtype)

    if "linear_attn_config" in config:
        kda = config["linear_attn_config"]
        shape = KimiLinearStateShape.create(tp_world_size=tp, num_heads=kda["num_heads"], head_dim=kda["head_dim"],
                                            conv_kernel_size=kda["short_conv_kernel_size"])
        return KimiLinearCacheParams(shape=shape, layers=list(range(n_gdn)),
                                     dtype=mamba2_state_dtype(None)).mamba_cache_per_req
    if "linear_num_key_heads" in config:
        shape = Mamba2StateShape.create(
            tp_world_size=tp, intermediate_size=config["linear_value_head_dim"] * config["linear_num_value_heads"],
            n_groups=config["linear_num_key_heads"], num_heads=config["linear_num_value_heads"],
            head_dim=config["linear_value_head_dim"], state_size=config["linear_key_head_dim"],
            conv_kernel=config["linear_conv_kernel_dim"])
    else:
        heads = config.get("mamba_num_heads") or config["mamba_n_heads"]
        head_dim = config.get("mamba_head_dim") or config["mamba_d_head"]
        shape = Mamba2StateShape.create(
            tp_world_size=tp, intermediate_size=heads * head_dim,
            n_groups=config.get("n_groups") or config["mamba_n_groups"], num_heads=heads, head_dim=head_dim,
            state_size=config.get("ssm_state_size") or config["mamba_d_state"],
            conv_kernel=config.get("conv_kernel") or config["mamba_d_conv"])
    return Mamba2CacheParams(shape=shape, layers=list(range(n_gdn)), dtype=mamba2_state_dtype(None)).mamba_cache_per_req


# Tail-Replay refuses Falcon-H1 and the frontier hybrids
SERVED_MODELS = [m for m in memory.ALL_MODELS if m != "Falcon-H1-7B" and m not in memory.FRONTIER]


@pytest.mark.parametrize("model", SERVED_MODELS)
def test_memory_anchor_columns_and_auto_hidden_dtype(model, monkeypatch):
    import torch
    from sglang.srt.configs.model_config import _get_and_verify_dtype

    from tailreplay_sglang.store import hidden_store
    from tailreplay_sglang.layout import HybridLayout

    monkeypatch.delenv("SGLANG_MAMBA_CONV_DTYPE", raising=False)
    monkeypatch.delenv("SGLANG_MAMBA_SSM_DTYPE", raising=False)
    _, config, _ = memory.resolve_model(model)
    layout = HybridLayout(tuple(config["layer_types"]), config["hidden_size"])
    for flag, served in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("auto", None)):
        acc = memory.account(model, ["--dtype", flag])
        served = served or _get_and_verify_dtype(config, "auto")  # the checkpoint's dtype as SGLang serves it
        assert memory.serving_dtype(config, ["--dtype", flag]) == served
        # hidden dtype auto = the serving dtype, as for the KV pool without --kv-cache-dtype
        assert acc["hidden_dtype_flag"] == "auto"
        assert acc["hidden_dtype"] == acc["kv_dtype"] == acc["serving_dtype"] == str(served).removeprefix("torch.")
        assert acc["tail_replay_hidden_bytes_per_token"] == hidden_store.bytes_per_token(layout, served)
        slot = acc["mamba_slot"]["total_bytes"]
        assert slot == _sglang_slot_bytes(config, acc["gdn_layers"])
        anchors = acc["anchors"]
        assert anchors["anchored"] and anchors["bytes_per_anchor"] == slot
        assert [row["interval"] for row in anchors["intervals"]] == list(memory.ANCHOR_INTERVALS)
        paper = acc["fa_kv_bytes_per_token"] + acc["tail_replay_hidden_bytes_per_token"]
        assert acc["paper_bytes_per_cached_token"] == acc["tail_replay_bytes_per_cached_token"] == paper
        assert acc["stock_bytes_per_cached_token"] == acc["fa_kv_bytes_per_token"]
        for row in anchors["intervals"]:
            assert row["anchor_bytes_per_token"] == slot / row["interval"]
            assert row["tail_replay_bytes_per_cached_token"] == paper + slot / row["interval"]
    # An explicit hidden dtype stays selectable.
    acc = memory.account(model, ["--dtype", "float32", "--tail-replay-hidden-dtype", "bfloat16"])
    assert acc["hidden_dtype"] == "bfloat16" and acc["kv_dtype"] == "float32"


def test_memory_row_of_a_refused_parallel_hybrid_says_what_the_store_would_cost(monkeypatch):
    """Falcon-H1-7B: attention in all 44 layers beside Mamba2, so Tail-Replay refuses it; its row carries the
    refusal and what the store would be (43 stored groups: every layer but the first is a group)."""
    from sglang.srt.configs.falcon_h1 import FalconH1Config

    monkeypatch.delenv("SGLANG_MAMBA_CONV_DTYPE", raising=False)
    monkeypatch.delenv("SGLANG_MAMBA_SSM_DTYPE", raising=False)
    _, config, _ = memory.resolve_model("Falcon-H1-7B")
    acc = memory.account("Falcon-H1-7B", ["--dtype", "auto"])
    assert "does not replay Falcon-H1" in acc["refused"] and "(6.0x the KV cache" in acc["refused"]
    assert (acc["fa_layers"], acc["gdn_layers"], acc["stored_groups"]) == (44, 44, 43)
    assert acc["fa_kv_bytes_per_token"] == 44 * 2 * 2 * 128 * 2  # K and V of 2 KV heads x 128, bfloat16
    assert acc["tail_replay_hidden_bytes_per_token"] == 43 * 3072 * 2 + 8
    assert acc["anchors"]["intervals"] == [] and not acc["anchors"]["anchored"]
    # SGLang's own Falcon-H1 config sizes the Mamba2 state from mamba_d_ssm: the same slot
    sglang_config = FalconH1Config(**{k: v for k, v in config.items() if k not in ("architectures", "dtype")})
    assert sglang_config.mamba_intermediate == config["mamba_n_heads"] * config["mamba_d_head"]
    assert acc["mamba_slot"]["total_bytes"] == _sglang_slot_bytes(config, 44)


def test_memory_rows_of_the_frontier_hybrids_say_what_the_store_would_cost(monkeypatch):
    """The frontier hybrids Tail-Replay refuses carry architectures.REFUSED's reason in their row, the served ones
    (Qwen3.8-Flash-Next, Ling-3.0, Ling-2.5, Kimi K3) none; the rows say what the store keeps or would keep: every
    hyper-connection stream of each stored group's input, and for Kimi K3 one row per group (its bank's rows are
    banked by the replays). The hidden rows per token against the KV (excluding the indexer): Qwen3.8-Flash-Next
    11 x 4 x 2048 x 2 B against 12 x 2 x 2 x 256 x 2 B, 7.3x; GLM-5.3-Flash 11 x 4 x 4096 x 2 B against 11 x 512 x 2 B,
    32x. The notes' "about 28x" is GLM's hiddens against KV + a DSA indexer sized at index_kpool 1 (SGLang's value
    where the config has none)."""
    from tailreplay_sglang.architectures import REFUSED

    monkeypatch.delenv("SGLANG_MAMBA_CONV_DTYPE", raising=False)
    monkeypatch.delenv("SGLANG_MAMBA_SSM_DTYPE", raising=False)
    acc = {name: memory.account(name, ["--dtype", "auto"]) for name in memory.FRONTIER}
    for name, row in acc.items():
        architecture = memory.FRONTIER[name]["architectures"][0]
        assert ("refused" in row) is (architecture not in SERVED), name
        if "refused" in row:
            assert REFUSED[architecture] in row["refused"]
            assert row["anchors"]["intervals"] == [] and row["hidden_dtype"] == row["kv_dtype"] == "bfloat16"
            assert row["tokens_that_fit"] == row["stock_bytes_per_cached_token"] / row["paper_bytes_per_cached_token"]
    qwen, glm = acc["Qwen3.8-Flash-Next"], acc["GLM-5.3-Flash"]
    assert (qwen["fa_layers"], qwen["gdn_layers"], qwen["stored_groups"], qwen["residual_streams"]) == (12, 36, 11, 4)
    assert qwen["fa_kv_bytes_per_token"] == 12 * 2 * 2 * 256 * 2 and qwen["indexer_bytes_per_token"] == 12 * 64
    assert qwen["tail_replay_hidden_bytes_per_token"] == 11 * 4 * 2048 * 2 + 8
    assert round(qwen["hiddens_per_kv"], 1) == 7.3
    assert (glm["fa_layers"], glm["gdn_layers"], glm["stored_groups"], glm["residual_streams"]) == (11, 34, 11, 4)
    assert glm["fa_kv_bytes_per_token"] == 11 * 512 * 2 and glm["indexer_bytes_per_token"] == 11 * 33
    assert glm["tail_replay_hidden_bytes_per_token"] == 11 * 4 * 4096 * 2 + 8
    assert round(glm["hiddens_per_kv"]) == 32
    kpool_1 = memory.account({**memory.FRONTIER["GLM-5.3-Flash"], "index_kpool": 1}, ["--dtype", "auto"])
    assert round(kpool_1["tail_replay_hidden_bytes_per_token"] / kpool_1["stock_bytes_per_cached_token"]) == 28
    # Kimi K3, served: 22 stored groups; its bank rows (block 12: layers 12 ... 84, all KDA) are banked by the groups'
    # replays, not stored
    kimi = acc["Kimi-K3"]
    assert (kimi["fa_layers"], kimi["gdn_layers"], kimi["stored_groups"], kimi["attn_res_bank_rows"]) == (24, 69, 22, 0)
    assert kimi["tail_replay_hidden_bytes_per_token"] == 22 * 7168 * 2 + 8 and "refused" not in kimi
    assert [(acc[m]["fa_layers"], acc[m]["gdn_layers"], acc[m]["stored_groups"])
            for m in ("Ling-3.0-flash", "Ling-2.5-1T")] == [(7, 35, 6), (10, 70, 9)]
    # Ling-2.5-1T: 9 stored groups of 8192 values against 10 MLA latents of 512 + 64, 12.8x
    assert acc["Ling-2.5-1T"]["tail_replay_hidden_bytes_per_token"] == 9 * 8192 * 2 + 8
    assert round(acc["Ling-2.5-1T"]["hiddens_per_kv"], 1) == 12.8


def _frontier_fields(name: str) -> dict:
    """A FRONTIER entry's fields as SGLang's config class takes them (no model_type, dtype or spelled-out layers)."""
    return {k: v for k, v in memory.FRONTIER[name].items() if k not in ("model_type", "dtype", "layer_types")}


def test_memory_frontier_shapes_match_sglangs_config_classes_and_pool_sizing(monkeypatch):
    """The frontier rows' layer split, indexer bytes and slot as SGLang 0.5.23's own config classes and pool sizing
    give them for the same fields; Qwen3.8-Flash-Next's shape is SGLang's Qwen4ExpTextConfig defaults."""
    from sglang.srt.configs.bailing_hybrid import BailingHybridConfig
    from sglang.srt.configs.glm5_next import Glm5NextTextConfig
    from sglang.srt.configs.kimi_linear import KimiLinearConfig
    from sglang.srt.configs.mamba_utils import (KimiLinearCacheParams, KimiLinearStateShape, Mamba2CacheParams,
                                                Mamba2StateShape, mamba2_state_dtype)
    from sglang.srt.configs.qwen4_exp import Qwen4ExpTextConfig
    from sglang.srt.layers.attention.qsa.config import parse_qsa_profile
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

    monkeypatch.delenv("SGLANG_MAMBA_CONV_DTYPE", raising=False)
    monkeypatch.delenv("SGLANG_MAMBA_SSM_DTYPE", raising=False)
    acc = {name: memory.account(name, ["--dtype", "auto"]) for name in memory.FRONTIER}
    qwen = Qwen4ExpTextConfig(full_attention_interval=4)
    shape_keys = ("hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                  "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                  "hc_count")
    published = memory.FRONTIER["Qwen3.8-Flash-Next"]
    assert {k: getattr(qwen, k) for k in shape_keys} == {k: published[k] for k in shape_keys}
    configs = {"Qwen3.8-Flash-Next": qwen, "GLM-5.3-Flash": Glm5NextTextConfig(**_frontier_fields("GLM-5.3-Flash")),
               "Kimi-K3": KimiLinearConfig(**_frontier_fields("Kimi-K3")),
               **{m: BailingHybridConfig(**_frontier_fields(m)) for m in ("Ling-3.0-flash", "Ling-2.5-1T")}}
    for name, config in configs.items():
        _, ours, _ = memory.resolve_model(name)
        assert [i for i, kind in enumerate(ours["layer_types"]) if kind == "full_attention"] == \
            config.full_attention_layer_ids
        assert acc[name]["gdn_layers"] == len(config.linear_layer_ids)
    profile = parse_qsa_profile(SimpleNamespace(**memory.FRONTIER["Qwen3.8-Flash-Next"]))
    assert acc["Qwen3.8-Flash-Next"]["indexer_bytes_per_token"] == QSATokenToKVPool.qsa_bytes_per_token(
        kv_heads=profile.kv_heads, head_dim=profile.head_dim, compress_ratio=profile.compress_ratio, num_layers=12)
    glm = configs["GLM-5.3-Flash"]  # pool_configurator._compute_dsa_indexer_cell_size, uint8 index-K buffer
    assert DSATokenToKVPool.index_k_with_scale_buffer_dtype.itemsize == 1
    dim = glm.index_head_dim
    per_layer = -(-(dim + dim // DSATokenToKVPool.quant_block_size * 4) // glm.index_kpool)
    assert acc["GLM-5.3-Flash"]["indexer_bytes_per_token"] == per_layer * 11
    assert configs["Ling-3.0-flash"].use_kda and not configs["Ling-2.5-1T"].use_kda
    dtype = mamba2_state_dtype(None)
    for name, heads in (("GLM-5.3-Flash", 64), ("Kimi-K3", 96), ("Ling-3.0-flash", 32)):
        shape = KimiLinearStateShape.create(tp_world_size=1, num_heads=heads, head_dim=128, conv_kernel_size=4)
        slot = KimiLinearCacheParams(shape=shape, layers=list(range(acc[name]["gdn_layers"])), dtype=dtype)
        assert acc[name]["mamba_slot"]["total_bytes"] == slot.mamba_cache_per_req
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=0, n_groups=0, num_heads=64, head_dim=128,
                                    state_size=128, conv_kernel=1)  # BailingHybridConfig.mamba2_cache_params
    slot = Mamba2CacheParams(shape=shape, layers=list(range(70)), dtype=dtype).mamba_cache_per_req
    assert acc["Ling-2.5-1T"]["mamba_slot"]["total_bytes"] == slot
    _, qwen_config, _ = memory.resolve_model("Qwen3.8-Flash-Next")
    assert acc["Qwen3.8-Flash-Next"]["mamba_slot"]["total_bytes"] == _sglang_slot_bytes(qwen_config, 36)


def test_memory_anchor_intervals_follow_the_server_flags():
    acc = memory.account("quality-qwen35", ["--dtype", "float32", "--tail-replay-anchor-interval", "1024"])
    assert [row["interval"] for row in acc["anchors"]["intervals"]] == [1024]
    assert acc["anchors"]["anchor_interval"] == 1024 and acc["tail_replay_slots_per_checkpoint"] == 1
    off = memory.account("quality-qwen35", ["--dtype", "float32", "--tail-replay-exact-budget", "0"])
    assert not off["anchors"]["anchored"] and off["anchors"]["intervals"] == []
    assert off["tail_replay_slots_per_checkpoint"] == 0
    # 16K prefilled in 4096-token chunks at N=512: 7 interval anchors + 1 chunk end per chunk.
    assert memory.anchors_in_prefix(16384, 512) == 32 and memory.anchors_in_prefix(5000, 0) == 2


def test_memory_all_table_and_json(tmp_path):
    out = tmp_path / "memory.json"
    accs = load_bench("memory").main(["--all", "--json", str(out)])
    data = json.loads(out.read_text())
    assert [m["model"] for m in data["models"]] == list(memory.ALL_MODELS) == [a["model"] for a in accs]
    assert "by hand" in data["note"]
    for m in data["models"]:
        assert {"fa_kv_bytes_per_token", "tail_replay_hidden_bytes_per_token", "mamba_slot", "anchors"} <= set(m)
    real = {m["model"]: m for m in data["models"]}
    assert real["Qwen3.5-4B"]["config_source"] == "hand-written shapes"
    assert (real["Qwen3.5-4B"]["fa_layers"], real["Qwen3.5-4B"]["gdn_layers"]) == (8, 24)
    assert (real["Qwen3.6-27B"]["fa_layers"], real["Qwen3.6-27B"]["gdn_layers"]) == (16, 48)
    assert real["Qwen3.6-27B"]["hidden_dtype"] == "bfloat16"  # --dtype auto on a bfloat16 checkpoint
    # Mamba2 hybrids: 4 attention layers each; Nemotron-H's MLP stages are not recurrent layers
    assert (real["Nemotron-H-8B"]["fa_layers"], real["Nemotron-H-8B"]["gdn_layers"]) == (4, 24)
    assert (real["Granite-4.0-H-Small"]["fa_layers"], real["Granite-4.0-H-Small"]["gdn_layers"]) == (4, 36)
    # Kimi Linear: 7 MLA layers keep a 512 + 64 latent each (bf16), 6 of its 7 KDA groups store a 2304-wide hidden
    kimi = real["Kimi-Linear-48B-A3B"]
    assert (kimi["fa_layers"], kimi["gdn_layers"], kimi["stored_groups"]) == (7, 20, 6)
    assert kimi["fa_kv_bytes_per_token"] == 7 * (512 + 64) * 2
    assert [m["model"] for m in data["models"] if "refused" in m] == [
        "Falcon-H1-7B", *(name for name in memory.FRONTIER if name not in FRONTIER_SERVED)]


PER_RANK_SERVED = [m for m in memory.PER_RANK_MODELS if m not in memory.FRONTIER]
# The frontier models Tail-Replay serves (Qwen3.8-Flash-Next, Ling-3.0, Ling-2.5, Kimi K3, GLM-5.3-Flash): rows, not
# refusals or projections
FRONTIER_SERVED = {name for name, config in memory.FRONTIER.items() if config["architectures"][0] in SERVED}


def test_memory_per_rank_shards_the_store_and_follows_sglangs_kv_and_state_sharding(monkeypatch):
    """Per attention-TP rank: the sharded bf16 store at TP 2 is about half of TP 1's (only the 8-byte token id stays
    whole); the host tier's device bytes are the KV (+ indexer) alone; a replicated store costs the same at every
    TP. The rank's KV heads are SGLang's get_num_kv_heads (an MLA latent whole on every rank) and its mamba slot
    SGLang's state shapes at that TP (Granite's one group extended to TP, as SGLang does)."""
    from sglang.srt.configs.model_config import ModelConfig

    monkeypatch.delenv("SGLANG_MAMBA_CONV_DTYPE", raising=False)
    monkeypatch.delenv("SGLANG_MAMBA_SSM_DTYPE", raising=False)
    for model in ("Qwen3.5-4B", "Qwen3.6-27B"):
        one, two = (memory.account_per_rank(model, tp)["sharded"]["store_bytes_per_token"] for tp in (1, 2))
        assert two <= 0.55 * one
    two = memory.account_per_rank("Qwen3.6-27B", 2)
    assert two["sharded"]["store_bytes_per_token"] == 15 * 5120 // 2 * 2 + 8  # 15 stored groups, 2560 columns
    assert two["fa_kv_bytes_per_token"] == 16 * 2 * 2 * 256 * 2  # 2 of 4 KV heads on each of 2 ranks
    for model in memory.PER_RANK_MODELS:
        _, config, _ = memory.resolve_model(model)
        tp_1 = memory.account(model, ["--dtype", "auto"])
        for dtype in memory.PER_RANK_HIDDEN_DTYPES:
            rows = {(tier, tp): memory.account_per_rank(model, tp, tier, dtype)
                    for tier in memory.PER_RANK_TIERS for tp in memory.TP_SIZES}
            replicated = {row["replicated"]["store_bytes_per_token"] for row in rows.values()}
            assert len(replicated) == 1  # independent of TP (and of the tier)
            if dtype == "bfloat16":
                assert replicated == {tp_1["tail_replay_hidden_bytes_per_token"]}
            for (tier, tp), row in rows.items():
                stock = row["stock"]["device_bytes_per_token"]
                assert stock == row["fa_kv_bytes_per_token"] + row["indexer_bytes_per_token"]
                assert row["indexer_bytes_per_token"] == tp_1["indexer_bytes_per_token"]  # QSA / DSA: whole
                width = config["hidden_size"] // tp
                row_bytes = {"bfloat16": width * 2, "float8_e4m3fn": width + 8,  # int4: codes, scales, 8-B words
                             "int4": -(-(width // 2 + width // 16) // 8) * 8}[dtype]
                assert row["sharded"]["store_bytes_per_token"] == row["stored_rows"] * row_bytes + 8
                for store in ("sharded", "replicated"):
                    placed = row[store]
                    if tier == "host":
                        assert placed["device_bytes_per_token"] == stock and placed["tokens_that_fit"] == 1
                        assert placed["host_bytes_per_token"] == placed["store_bytes_per_token"]
                    else:
                        assert placed["device_bytes_per_token"] == stock + placed["store_bytes_per_token"]
                        assert placed["host_bytes_per_token"] == 0
                if tier == "host" and model in PER_RANK_SERVED:
                    assert row["sharded"]["device_bytes_per_token"] == row["fa_kv_bytes_per_token"]  # the KV alone
                if config.get("kv_lora_rank"):
                    assert row["fa_kv_bytes_per_token"] == tp_1["fa_kv_bytes_per_token"]
                else:
                    sglang = SimpleNamespace(get_total_num_kv_heads=lambda: config["num_key_value_heads"],
                                             is_draft_model=False)
                    heads = ModelConfig.get_num_kv_heads(sglang, tp)
                    assert row["fa_kv_bytes_per_token"] == tp_1["fa_kv_bytes_per_token"] // config[
                        "num_key_value_heads"] * heads
                if model in PER_RANK_SERVED:
                    assert row["mamba_slot_bytes"] == _sglang_slot_bytes(config, row["recurrent_layers"], tp)
                else:
                    assert row["mamba_slot_bytes"] == tp_1["mamba_slot"]["total_bytes"] // tp
    # Whole rows where the hidden size does not split, and for an MLA model with a HiCache storage backend
    assert memory.store_shards({"hidden_size": 2560}, 3) == 1
    assert memory.store_shards(memory.HAND_WRITTEN["Kimi-Linear-48B-A3B"], 2, hicache_storage=True) == 1
    assert memory.store_shards(memory.HAND_WRITTEN["Qwen3.6-27B"], 2, hicache_storage=True) == 2


def test_memory_per_rank_table_and_json(tmp_path):
    out = tmp_path / "per_rank.json"
    rows = load_bench("memory").main(["--per-rank", "--tp", "1", "2", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["rows"] == rows and data["tp_sizes"] == [1, 2]
    assert len(rows) == len(memory.PER_RANK_MODELS) * 2 * len(memory.PER_RANK_TIERS) * 3  # TP 1, 2; 3 row dtypes
    assert FRONTIER_SERVED == {"Ling-3.0-flash", "Ling-2.5-1T", "Qwen3.8-Flash-Next", "Kimi-K3", "GLM-5.3-Flash"}
    assert {r["model"] for r in rows if r["projection"]} == set(memory.FRONTIER) - FRONTIER_SERVED
    assert {r["model"] for r in rows if not r["projection"]} == set(PER_RANK_SERVED) | FRONTIER_SERVED
    assert "not measured" in data["note"]


def test_image_chat_shapes_and_summary():
    """The fork shares one image and document across its requests (the chat gives each client its own), and the
    summary counts only the requests that could hit, against the other server's answers."""
    from types import SimpleNamespace

    image_chat = load_bench("image_chat")
    args = SimpleNamespace(seed=0, width=32, height=32, doc_words=5, clients=2, forks=3)
    fork = image_chat.conversations(args, "screenshot fork")
    chat = image_chat.conversations(args, "multi-turn chat")
    assert len({image for image, _ in fork}) == 1 and len({text for _, text in fork}) == 3
    assert len({image for image, _ in chat}) == 2

    def turn(cached, first, exact, ids):
        return dict(prompt_tokens=100, cached=cached, ttft_s=0.1 if cached else 1.0, first=first, exact=exact,
                    output_ids=ids)

    turns = {"Tail-Replay": [turn(0, True, True, [1]), turn(90, False, True, [2]), turn(80, False, False, [3])],
             "stock": [turn(0, True, None, [1]), turn(0, False, None, [2]), turn(0, False, None, [4])]}
    summary = image_chat.summarise(turns)
    assert summary["Tail-Replay"]["cached_share"] == 0.85 and summary["Tail-Replay"]["exact_share"] == 0.5
    assert summary["stock"]["cached_share"] == 0 and summary["stock"]["exact_share"] is None
    assert summary["stock"]["cold_ttft_p50_s"] == 1.0 and summary["Tail-Replay"]["ttft_p50_s"] == 0.1
    assert summary["Tail-Replay"]["same_answers_as_other"] == 2


class _Recorder:
    """Stands in for bench/pressure.py's Arm: records each prompt, answers with fixed ids."""

    def __init__(self):
        self.prompts = []

    def send(self, session, ids, max_new_tokens=16):
        self.prompts.append((session, list(ids)))
        return [7] * max_new_tokens


def test_pressure_trace_is_the_same_for_every_arm_and_shares_prefixes():
    """bench/pressure.py's trace: the same prompts for every arm (given the same answers), tenants' system prompts
    distinct, and each kind shares what it should: chat turns extend the previous turn, forks cut the document,
    continuations extend their answer."""
    pressure = load_bench("pressure")
    args = SimpleNamespace(seed=0, tenants=2, scale=0.1)
    runs = []
    for _ in range(2):
        rec = _Recorder()
        for session in pressure.trace(args, vocab=1000):
            session(rec)
        runs.append(rec.prompts)
    assert runs[0] == runs[1] and len(runs[0]) == 2 * (2 * 4 + 4 + 3)
    by_session = {}
    for name, ids in runs[0]:
        by_session.setdefault(name, []).append(ids)
    heads = {prompts[0][0] for prompts in by_session.values()}
    assert len(heads) == 2  # one system prompt per tenant, each session of a tenant starts with it
    for name, prompts in by_session.items():
        if "forks" in name:
            assert all(p[:len(p) - 5] == prompts[0][:len(p) - 5] for p in prompts[1:])
        else:
            assert all(b[:len(a)] == a for a, b in zip(prompts, prompts[1:]))  # each turn extends the last


# ---- bench/overhead.py: its summary, without servers ----

def test_overhead_ratios_pair_each_repetition_and_report_every_server_pair():
    """Tail-Replay / stock is taken within a repetition (the two servers measured back to back), its median and
    min-max over every repetition, and the median per server pair (each pair is started afresh: a process keeps a
    speed of its own)."""
    overhead = load_bench("overhead")
    samples = [{"pair": pair, "rep": 2 * pair + rep, "name": "cold 2048", "arm": arm, "value": value}
               for pair, rep, arm, value in [(0, 0, "stock", 1.0), (0, 0, "tail_replay", 1.1),
                                             (0, 1, "stock", 2.0), (0, 1, "tail_replay", 2.0),
                                             (1, 0, "stock", 1.0), (1, 0, "tail_replay", 0.9),
                                             (1, 1, "tail_replay", 5.0)]]  # its stock run is missing: no ratio
    (row,) = overhead.summarize(samples, ["cold 2048"])
    assert row["reps"] == 3 and row["ratio_min"] == 0.9 and abs(row["ratio_max"] - 1.1) < 1e-12
    assert row["ratio_median"] == 1.0 and [round(x, 6) for x in row["ratio_median_per_pair"]] == [1.05, 0.9]
    assert row["stock_median"] == 1.0 and row["tail_replay_median"] == 1.55  # every sample of each arm


def test_page_faults_ratio_pairs_the_same_prompt_and_skips_each_servers_first():
    """bench/page_faults.py: Tail-Replay / stock TTFT per repetition of one policy (both servers got that
    repetition's prompt), its first request (heap growth under either policy) left out; the /proc counters of a
    process tree are read for a live process."""
    import os

    page_faults = load_bench("page_faults")
    samples = [{"policy": policy, "rep": rep, "arm": arm, "ttft_s": t}
               for policy, rep, arm, t in [("kept", 0, "stock", 1.0), ("kept", 0, "tail_replay", 9.0),
                                           ("kept", 1, "stock", 2.0), ("kept", 1, "tail_replay", 2.2),
                                           ("kept", 2, "stock", 4.0), ("kept", 2, "tail_replay", 4.0),
                                           ("glibc", 1, "stock", 1.0), ("glibc", 1, "tail_replay", 3.0)]]
    assert abs(page_faults.ratio(samples, "kept") - 1.05) < 1e-12
    assert page_faults.ratio(samples, "glibc") == 3.0
    faults, user, system = page_faults.counters(os.getpid())
    assert faults > 0 and user > 0 and system >= 0


def test_pd_counts_what_crosses_the_wire_and_tabulates_both_arms():
    pd = load_bench("pd")
    result = {"requests": 3, "kv_tokens_sent": 1000, "prompt_tokens": 1000, "cached": 600, "matchable": 600,
              "computed": 400, "replayed": 88, "hits": 2, "exact_hits": 2, "ttft_p50_s": 0.5, "ttft_p99_s": 0.9,
              "requests_per_s": 1.0}
    pd.add_wire_bytes(result, {"kv_bytes_per_token": 512, "state_bytes": 29184})
    assert result["transfer_bytes"] == 1000 * 512 + 3 * 29184
    table = pd.table({"RAG / agent": {"stock": result, "Tail-Replay": result}})
    assert table.row_count == 2
