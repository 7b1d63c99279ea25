"""Tail-Replay flags on the stock entry point: registered by the installed plugin, refused at start-up with a
message naming the flag (the launcher exits before any model is loaded)."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from tailreplay_sglang.config import TailReplayConfigError
from tailreplay_sglang.plugin import add_cli_args, config_from_args


def launch_all(launches: dict[str, tuple], timeout=300) -> dict[str, subprocess.CompletedProcess]:
    """`python -m sglang.launch_server --device cpu ARGS` for each entry, all at once (each is ~12 s of imports before
    the launcher exits; their tests are marked `server`): {name: completed process, output captured}."""
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    procs = {name: subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--device", "cpu", *args],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for name, args in launches.items()}
    done = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs.values():
                other.kill()
            raise
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return done


@pytest.fixture(scope="module")
def launches(tiny_qwen35, tmp_path_factory):
    """Every real launch of this module, run together."""
    dense = tmp_path_factory.mktemp("dense")
    (dense / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 8}))
    return launch_all({
        "help": ("--help",),
        **{name: ("--model-path", str(tiny_qwen35), *args) for name, (args, _) in LAUNCHED.items()},
        "dense": ("--model-path", str(dense), "--enable-tail-replay"),
    })


@pytest.mark.server
def test_flags_appear_in_stock_help(launches):
    out = launches["help"]
    assert out.returncode == 0
    for flag in ("--enable-tail-replay", "--tail-replay-ratio", "--tail-replay-min-tokens", "--tail-replay-max-tokens",
                 "--tail-replay-hidden-dtype", "--tail-replay-mode", "--tail-replay-hidden-tier", "--tail-replay-h2d",
                 "--tail-replay-anchor-interval", "--tail-replay-exact-budget"):
        assert flag in out.stdout


# Each case's message, checked by the code the launcher runs (`plugin.config_from_args` on the parsed flags) without
# a launch: a launch costs ~15 s of imports. The first also goes through the real launcher below.
REFUSED = [
    (["--enable-tail-replay", "--tail-replay-ratio", "2"], "--tail-replay-ratio must be in (0, 1]"),
    (["--tail-replay-ratio", "0.1"], "--tail-replay-ratio requires --enable-tail-replay"),
    (["--enable-tail-replay", "--tail-replay-min-tokens", "100", "--tail-replay-max-tokens", "10"],
     "--tail-replay-min-tokens (100) must not exceed --tail-replay-max-tokens (10)"),
    (["--enable-tail-replay", "--disable-radix-cache"], "does not support --disable-radix-cache"),
    (["--enable-tail-replay", "--tail-replay-anchor-interval", "100"],
     "--tail-replay-anchor-interval must be 0 (off) or a positive multiple of 64"),
    (["--enable-tail-replay", "--tail-replay-exact-budget", "-5"], "--tail-replay-exact-budget must be >= 0"),
    (["--tail-replay-exact-budget", "0"], "--tail-replay-exact-budget requires --enable-tail-replay"),
    (["--enable-tail-replay", "--pp-size", "2"], "--enable-tail-replay supports --pp-size 1 only"),
    (["--enable-tail-replay", "--disaggregation-mode", "decode", "--tail-replay-anchor-interval", "1024"],
     "--tail-replay-anchor-interval has no effect on a PD decode server"),
    (["--enable-tail-replay", "--disaggregation-mode", "prefill", "--tail-replay-host-anchors", "4"],
     "--tail-replay-host-anchors is not tested on a PD prefill server"),
]
REFUSED_IDS = ["ratio-out-of-range", "option-without-enable", "min-above-max", "disabled-radix-cache",
               "anchor-interval-off-chunk", "negative-budget", "budget-without-enable", "pipeline",
               "replay-flag-on-a-decode-server", "host-anchors-on-a-prefill-server"]


def launcher_parser() -> argparse.ArgumentParser:
    """The launcher's flags these cases use, and the plugin's (`add_cli_args`, as SGLang's parser gets them)."""
    parser = argparse.ArgumentParser()
    for flag in ("--model-path", "--device", "--pp-size", "--disaggregation-mode"):
        parser.add_argument(flag, type=int if flag == "--pp-size" else str)
    for flag in ("--disable-radix-cache", "--disable-cuda-graph"):
        parser.add_argument(flag, action="store_true")
    add_cli_args(parser)
    return parser


@pytest.mark.parametrize("args,message", REFUSED, ids=REFUSED_IDS)
def test_invalid_flags_are_refused_naming_the_flag(tiny_qwen35, args, message):
    with pytest.raises(TailReplayConfigError) as refused:
        config_from_args(launcher_parser().parse_args(["--model-path", str(tiny_qwen35), *args]))
    assert message in str(refused.value)


def test_an_unknown_choice_is_refused_by_the_parser(tiny_qwen35, capsys):
    """argparse's own refusal (exit status 2, the launcher's too) for a value outside a flag's choices."""
    with pytest.raises(SystemExit) as refused:
        launcher_parser().parse_args(["--model-path", str(tiny_qwen35), "--enable-tail-replay",
                                      "--tail-replay-hidden-tier", "disk"])
    assert refused.value.code == 2
    assert "--tail-replay-hidden-tier: invalid choice" in capsys.readouterr().err


LAUNCHED = {"ratio-out-of-range": REFUSED[0]}  # a refusal that also goes through the real launcher


@pytest.mark.parametrize("name", list(LAUNCHED))
@pytest.mark.server
def test_the_launcher_exits_at_start_up_naming_the_flag(launches, name):
    out = launches[name]
    assert out.returncode == 2
    assert LAUNCHED[name][1] in out.stderr


@pytest.mark.server
def test_model_without_linear_attention_is_refused_with_what_is_supported(launches):
    out = launches["dense"]
    assert out.returncode == 2
    assert "linear-attention" in out.stderr and "Supported: Qwen3.5" in out.stderr
