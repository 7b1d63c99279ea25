"""What Tail-Replay keeps per request, and the hand-off of a hit from its match to its replay.

`TailReplayReq` hangs on SGLang's `Req` through the one attribute `tail_replay` (`state_of`); nothing else of ours
rides on a `Req`. Two more names mark SGLang objects the radix cache passes around, defined here beside it: an
insert's held-back track state and taint (`InsertParams`), and a tree node's taint.
"""

from dataclasses import dataclass, field

REQ_ATTR = "tail_replay"  # on a Req: its TailReplayReq
# On InsertParams under extra_buffer: (depth, slot) of an exact request's track-point state, inserted after its KV.
STATE_DEPTH_ATTR = "tail_replay_state_at"
# True on a tree node whose KV (and hiddens) an approximate request computed; on InsertParams, from such a request.
TAINT_ATTR = "tail_replay_tainted"


@dataclass(frozen=True)
class Match:
    matched: int  # m: tokens of KV reused
    anchor: int | None  # c: the replay starts from the state kept at this depth (0: the root); None: zero-init tail
    exact: bool = False  # the rebuilt state is exact: an anchor, or a zero-init tail covering the whole match
    reset: bool = False  # the slot holds a state staged for another prefix: zero it before the replay (`retarget`)


def retarget(match: Match, prefix: int, clean: bool, config) -> Match:
    """The hit as the replay must serve it when the request's final prefix is not the m its match planned for.

    The scheduler can settle on another prefix after the match: a load-back that brings none of the host tokens
    planned for (re-planned before the batch forms, `TailReplayMambaComponent.replan_after_load`, where it can be),
    or a request matched again while it already held its slot, whose match keeps the first plan. The slot then holds
    the planned anchor's state (copied by the forward) or a cleared one, and this keeps the rebuilt state right for
    `prefix`: from the same anchor if it lies within the prefix (exact, whatever the budget), else from a zeroed
    slot, by the rule a match applies (`plan_hit`). `clean`: the prefix's KV is untainted."""
    if match.matched == prefix:
        return match
    if match.anchor is not None and match.anchor <= prefix:
        return Match(prefix, match.anchor, exact=clean)
    reset = match.anchor is not None  # the slot holds a state from past the prefix
    if config.anchored and prefix <= config.budget(prefix):
        return Match(prefix, 0, exact=clean, reset=reset)
    return Match(prefix, None, exact=clean and config.is_exact_fallback(prefix), reset=reset)


@dataclass
class TailReplayReq:
    # Set by the cache at the match (`cache/component.py`), taken by `lifecycle.mark_pending` once the request has
    # its pool row: the hit whose states the replay pass rebuilds before the extend.
    match: Match | None = None
    # Whether the request's recurrent state is exact; set at the match, cleared by the cache when the request's row
    # is re-pointed at tainted KV. Only an exact request donates anchors. Reported as `tail_replay_exact`.
    exact: bool = False
    # [(depth, mamba slot, its physical id)] of the interval anchors planned for its last prefill forward
    # (`cache/anchors.py`), until they are inserted into the tree or freed.
    interval_anchors: list = field(default_factory=list)
    # Set once the request is matched again (a retraction's re-admission, a PD rebootstrap) after it emitted output
    # while its state was approximate: the new match recomputes its decoded tokens, but what it already sent came
    # from that state, so it stays approximate (review F2, F5).
    emitted_approximate: bool = False
    # What the replay did for it (`replay.run_pending`), reported once in meta_info (`visibility.py`):
    anchor: int | None = None  # depth of the anchor the replay started from, or None (zero-init tail)
    tokens: int = 0  # tokens replayed
    ms: float = 0.0  # wall time of the replay pass that served it
    state_survival: float | None = None  # zero-init tails only: the bound on the dropped state's share at m
    # The hit's length before a fold cut it back to its anchor (`component.plan_hit`), which is what SGLang's storage
    # lookup, matching without the fold, saw (`hierarchy.keep_folded_match`); None when the hit did not fold.
    folded_from: int | None = None


def relabel(req, exact: bool) -> TailReplayReq:
    """Label the request's state at a (re-)admission's match: exact only if the new match is and no output it
    already emitted came from an approximate state. The previous admission's replay figures go with it (F6)."""
    state = state_of(req)
    if getattr(req, "output_ids", None) and not state.exact:
        state.emitted_approximate = True
    state.exact = exact and not state.emitted_approximate
    state.anchor, state.tokens, state.ms, state.state_survival = None, 0, 0.0, None
    return state


def state_of(req) -> TailReplayReq:
    """The request's Tail-Replay state, created on first use."""
    state = getattr(req, REQ_ATTR, None)
    if state is None:
        state = TailReplayReq()
        setattr(req, REQ_ATTR, state)
    return state


def peek(req) -> TailReplayReq | None:
    """The request's state, or None for a request Tail-Replay never saw (no match passed our cache)."""
    return getattr(req, REQ_ATTR, None)


def is_tainted(node) -> bool:
    """Whether any node on the path from the root to `node` holds KV an approximate request computed."""
    while node is not None:
        if getattr(node, TAINT_ATTR, False):
            return True
        node = node.parent
    return False


def is_exact(req) -> bool:
    """Whether the request's state is exact. A request that never passed our match (one that brings its own state:
    a PD-decode transfer, a session continuation) is not known to be exact, so it donates no anchor."""
    state = peek(req)
    return state is not None and state.exact


class PendingReplays:
    """Hit requests between prepare_for_extend and their forward, keyed by request-pool row (a `ForwardBatch`
    carries rows, not `Req`s)."""

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
