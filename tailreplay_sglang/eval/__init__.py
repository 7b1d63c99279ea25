"""Evaluation and test tooling, never imported by a server: the checkpoint builder (`models`, `corpus`), the task
suites (`tasks`), training of the quality model (`training`), the HF transformers reference (`reference`) and the
server harness that starts and stops `sglang.launch_server` (`server`)."""
