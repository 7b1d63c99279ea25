"""Tail-Replay prefix caching for hybrid (full-attention + recurrent) models, as an SGLang 0.5.23 plugin."""

__version__ = "0.1.0"
