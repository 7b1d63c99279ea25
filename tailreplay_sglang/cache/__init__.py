"""The radix-cache side of Tail-Replay (scheduler process).

- `component`: the radix-cache backend `tail_replay`, SGLang's UnifiedRadixCache with a MAMBA component that matches
  at any token and copies the nearest anchor into a hit's slot;
- `anchors`: interval anchors, planned before a prefill forward and inserted into the tree after it;
- `pending`: a hit between its match and its replay.

Importing `component` imports SGLang's cache modules; this package's `__init__` imports nothing.
"""
