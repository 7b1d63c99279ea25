"""bench/ttft_gpu.py at --small sizes on CPU, and tailreplay_sglang.store.transfer's CPU behaviour.

The GPU run itself (streams, events, pinned copies, fla) needs a CUDA device; here the same code runs with
synchronous copies, which pins down everything but the timing: the table's layout, the JSON, the ratio-1 check, and
that the serialized and overlapped paths compute the same thing. One run forces the Triton replay kernels
(interpreted), so the GPU replay's call sites (strides, dtypes, pool layouts) run here too.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tailreplay_sglang.store.transfer import HostToDevice, copy_all_blocking, pin

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "ttft_gpu.py"


def _run(tmp_path, *args, env=None):
    out = tmp_path / "ttft.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--small", "--device", "cpu", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ttft"))


def test_small_run_has_every_row_and_column(small_run):
    stdout, result = small_run
    assert [row["prefix"] for row in result["rows"]] == [256, 512]
    for row in result["rows"]:
        assert row["full_ms"] > 0 and len(row["full_times_ms"]) == result["reps"] == 3
        assert list(row["ratios"]) == ["0.05", "0.1"]
        for r, cell in row["ratios"].items():
            assert cell["tail_tokens"] == math.ceil(float(r) * row["prefix"])
            for path in ("ser", "ovl_skip"):
                assert cell[f"{path}_ms"] > 0 and len(cell[f"{path}_times_ms"]) == 3
                assert cell[f"{path}_speedup"] == pytest.approx(row["full_ms"] / cell[f"{path}_ms"])
    assert result["device"] and result["date"] and result["model"]["parameters"] > 0
    # the paper's layout: one line per prefix under two header lines naming the paths per replay ratio
    assert "5% replay" in stdout and "10% replay" in stdout and stdout.count("H2D-OVL+skip") == 2
    assert any(line.split()[:1] == ["512"] for line in stdout.splitlines())


def test_small_run_check_passes(small_run):
    """On a CPU both transfer modes return their input, so ser == ovl says something on CUDA only."""
    stdout, result = small_run
    check = result["check"]
    assert check["passed"] and "PASSED" in stdout
    assert check["skip_vs_no_skip"] == 0.0
    if torch.cuda.is_available():
        assert check["ser_equals_ovl"]
    assert check["err_ser"] <= 1e-4 and check["err_ovl_skip"] <= 1e-4
    assert check["err_zero_states"] > 100 * check["err_ser"]  # the check can tell a replayed state from none


def test_check_with_triton_replay_kernels_interpreted(tmp_path):
    stdout, result = _run(tmp_path, "--replay-kernels", "triton", "--check-only", "--check-length", "32",
                          "--suffix", "4", env={"TRITON_INTERPRET": "1"})
    assert result["check"]["passed"] and result["rows"] == []


# ---- store/transfer.py on CPU ----

def _host_tensors():
    return {"ids": torch.arange(10), ("hidden", 1): torch.randn(10, 8), 3: torch.randn(2, 2, 10, 4),
            "empty": torch.empty(0, 8)}


@pytest.mark.parametrize("mode", ["ser", "ovl"])
def test_transfer_on_cpu_returns_the_tensors_and_waits_are_no_ops(mode):
    host = _host_tensors()
    h2d = HostToDevice("cpu", mode)
    out = {key: h2d.copy(key, t) for key, t in host.items()}
    for key in host:
        h2d.wait(key)
    h2d.wait("never copied")
    h2d.wait_all()
    assert h2d.stream is None and h2d.events == {}
    for key, t in out.items():
        assert t is host[key]  # host == device: nothing to move


def test_transfer_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        HostToDevice("cpu", "async")


def test_pin_is_identity_without_cuda():
    t = torch.randn(3)
    if not torch.cuda.is_available():
        assert pin(t) is t
    else:
        assert pin(t).is_pinned() and torch.equal(pin(t), t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["ser", "ovl"])
def test_transfer_on_cuda_matches_blocking_copies(mode):
    host = {key: pin(t) for key, t in _host_tensors().items()}
    h2d = HostToDevice("cuda", mode)
    out = {key: h2d.copy(key, t) for key, t in host.items()}
    h2d.wait_all()
    assert (h2d.stream is not None) == (mode == "ovl")
    assert set(h2d.events) == (set(host) - {"empty"} if mode == "ovl" else set())  # one event per non-empty copy
    for key, t in copy_all_blocking(host, "cuda").items():
        assert torch.equal(out[key], t)
    if mode == "ovl":
        with pytest.raises(ValueError, match="pinned"):
            h2d.copy("pageable", torch.randn(4))


def test_gpu_check_runs_here_and_reports_what_needs_cuda_as_skipped(tmp_path):
    """scripts/gpu_check.sh as a lent device runs it (no wheels carried here): every part is reported, the ones that
    need CUDA as skipped with the reason, and the JSON is written."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--skip", "serving", "--out", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable, "WHEELS": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["serving"] == {"status": "skipped", "reason": "--skip"}
    for part in ("kernels", "kernel_bench", "ttft"):
        assert report[part]["status"] == ("skipped" if not torch.cuda.is_available() else "passed"), report[part]
