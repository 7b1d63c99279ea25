"""Tail-Replay prefix caching for hybrid (full-attention + Gated DeltaNet) models, as an SGLang 0.5.23 plugin."""

__version__ = "0.1.0"
