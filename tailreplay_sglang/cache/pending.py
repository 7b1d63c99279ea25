"""A hit between its match (`cache/component.py`) and its replay (`replay.py`): what was matched, from where it
replays."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Match:
    matched: int  # m: tokens of KV reused
    anchor: int | None  # c: the replay starts from the state kept at this depth (0: the root); None: zero-init tail
    exact: bool = False  # the rebuilt state is exact: an anchor, or a zero-init tail covering the whole match


class PendingReplays:
    """Hit requests between prepare_for_extend and their forward, keyed by request-pool row."""

    def __init__(self):
        self._by_row: dict[int, tuple[Match, object]] = {}

    def add(self, req_pool_idx: int, match: Match, req) -> None:
        self._by_row[req_pool_idx] = (match, req)

    def take(self, req_pool_indices: list[int], prefix_lens: list[int]) -> list[tuple[int, Match, object]]:
        """(batch row, match, req) of rows whose pending match is the prefix they extend from."""
        rows = []
        for row, (pool_idx, prefix) in enumerate(zip(req_pool_indices, prefix_lens)):
            match, req = self._by_row.pop(pool_idx, (None, None))
            if match is not None and match.matched == prefix and prefix > 0:
                rows.append((row, match, req))
        # An entry lives from one prepare_for_extend to that batch's forward. One left over (its request was
        # aborted or retracted in between) must not be picked up by a later request on the same row.
        self._by_row.clear()
        return rows

    def __len__(self) -> int:
        return len(self._by_row)
