"""The radix-cache side of Tail-Replay in the scheduler process (`docs/structure.md` maps its modules)."""
