"""Evaluation and test tooling for tailreplay-sglang, kept out of the plugin.

A development package: it lives next to `tailreplay_sglang/` in the repository, is importable in the dev venv (the
editable install puts the repository root on `sys.path`), and is not shipped in the wheel, which holds the runtime
only. The runtime never imports it (tests/test_structure.py checks both). What is here: the checkpoint builder
(`models`, `corpus`), the task suites (`tasks`), training of the quality model (`training`), the HF transformers
reference (`reference`), the server harness that starts and stops `sglang.launch_server` and `sglang-router`
(`server`), a scripted `sglang.Engine` run in a process of its own (`engine_run`), and what the scripts in bench/
share (`harness`, `client`, `memory`, `bench_serving`)."""
