"""Exact prompt-lookup speculative decoding: an n-gram drafter, the acceptance rule, the draft length.

Replies that copy their input (correct, rewrite, extract, quote) repeat long runs of tokens that are already
in the prompt. The drafter proposes the continuation of the latest earlier occurrence of the last few
tokens (no draft model), the engine feeds the pending token and the draft in ONE forward pass (the graph's
num_logits_to_keep gives a row of logits per position), and each drafted token is then decided in order:

- the token is sampled from that position's row exactly as plain decoding samples it (the same sampler,
  the same uniform from the request's generator) and the drafted token is accepted when it is the token
  drawn. Greedy, the draw is the argmax. Sampling, this is speculative sampling for a point-mass draft:
  acceptance has probability p(x), as in Leviathan et al.'s rule (min(1, p(x)/q(x)) with q = 1 at x),
  which is the most any rule can accept from a deterministic draft, and a rejected position's token is
  distributed as p without x, renormalised, as that rule's residual is. Coupling the acceptance with the
  draw keeps more: the reply is the non-speculative reply for the same seed, token for token.

Either way a reply depends on the rows, not on the draft lengths (which follow timing, below), because a
verification row equals the row of feeding its position alone up to summation order (the engine speculates
only on variants whose probe says so, DecoderSession.rows_exact). Such a difference (at most 1e-3 in a
logit, ~6e-5 on SmolLM2 q4) moves a draw only when its uniform falls that close to a boundary between two
tokens, as reusing a cached prompt prefix (other chunk sizes) already may.

Not on q4-a8 (onnxruntime 1.32, x86, AVX2): its one-row pass differs from a verification row by up to ~0.8 in
a logit, though rows of passes with two or more positions are bitwise equal (measured on the real graph).
Padding every decode step to two rows would make speculation exact there, but a two-row pass costs 1.40-1.52x
a one-row pass at 1 thread (1.30-1.42x at 2), so with SmolLM2's measured acceptance on the rewrite tasks
(0.62-0.66) the best draft would gain ~1.09x over plain one-row decoding, and a chat reply (no drafts) would
lose ~1/3; it is not built.

The draft length maximises expected tokens per unit of forward-pass cost: with per-token acceptance a
(geometric), k drafted tokens yield (1 - a^(k+1)) / (1 - a) tokens for a pass costing 1 + c*k decode
steps, c being the measured cost of an extra row (small where decode is memory bound; large on a core
without int8 dot products). Proposals are checked against every emitted token, verified or not, so when
acceptance is low drafting stops (k = 0: a plain decode step plus a dictionary lookup) and it resumes
when the reply starts copying.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from models.runtime.sampling import Sampler, TopLogprobs

NGRAM_SIZES = (3, 2, 1)  # longest match first: a longer context predicts the continuation better
MAX_DRAFT = 8
PRIOR_ROW_COST = 0.35  # an extra row's cost relative to a decode step, until passes are measured


class NgramDrafter:
    """Prompt lookup over an append-only history (prompt + reply, one list grown in place; another list
    starts the index over): for each n, the latest position where each n-gram ended with a token after
    it."""

    def __init__(self, sizes: Sequence[int] = NGRAM_SIZES) -> None:
        self.sizes = tuple(sorted(set(sizes), reverse=True))
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # history[:_indexed] has its n-grams (with a continuation) indexed
        self._source: Sequence[int] = ()

    def _sync(self, history: Sequence[int]) -> None:
        if history is not self._source or len(history) < self._indexed:  # not an append: start over
            self._index = {n: {} for n in self.sizes}
            self._indexed = 0
        # n-grams ending at j are indexed once token j + 1 exists
        for j in range(max(self._indexed - 1, 0), len(history) - 1):
            for n in self.sizes:
                if j + 1 >= n:
                    self._index[n][tuple(history[j + 1 - n : j + 1])] = j
        self._indexed = len(history)
        self._source = history

    def propose(self, history: Sequence[int]) -> int | None:
        """The token that followed the latest earlier occurrence of the history's longest matching tail."""
        self._sync(history)
        return self._propose(history, [], {})

    def draft(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens: each the proposal for the history extended by the ones before it."""
        self._sync(history)
        out: list[int] = []
        overlay: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        while len(out) < k:
            x = self._propose(history, out, overlay)
            if x is None:
                break
            # the assumed history now continues its last position with x: index the n-grams ending there
            end = len(history) + len(out) - 1
            out.append(x)
            for n in self.sizes:
                if end + 1 >= n:
                    overlay[n][self._tail(history, out[:-1], n)] = end
        return out

    def _tail(self, history: Sequence[int], extra: list[int], n: int) -> tuple[int, ...]:
        if n <= len(extra):
            return tuple(extra[len(extra) - n :])
        return tuple(history[len(history) - (n - len(extra)) :]) + tuple(extra)

    def _propose(
        self, history: Sequence[int], extra: list[int], overlay: dict[int, dict[tuple[int, ...], int]]
    ) -> int | None:
        length = len(history) + len(extra)
        for n in self.sizes:
            if length < n + 1:
                continue
            key = self._tail(history, extra, n)
            j = overlay.get(n, {}).get(key)  # later than any indexed position
            if j is None:
                j = self._index[n].get(key)
            if j is not None:
                return history[j + 1] if j + 1 < len(history) else extra[j + 1 - len(history)]
        return None


class RowCost:
    """The cost of a forward pass of m rows relative to one row, c in t(m) = t(1) * (1 + c * (m - 1)), fitted
    by least squares over the last passes of one session (m = 1 passes included). Timing noise changes
    draft lengths, never the reply."""

    def __init__(self, prior: float = PRIOR_ROW_COST, window: int = 48) -> None:
        self.c = prior
        self._passes: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, rows: int, seconds: float) -> None:
        self._passes.append((rows, seconds))
        if len(self._passes) < 4:
            return
        m = np.array([p[0] for p in self._passes], np.float64)
        t = np.array([p[1] for p in self._passes], np.float64)
        if m.std() < 0.5:  # one size only: no slope to see
            return
        slope, intercept = np.polyfit(m, t, 1)
        one = intercept + slope
        if one > 0:
            self.c = float(min(max(slope / one, 0.01), 2.0))


class DraftPolicy:
    """Acceptance per proposed token (recent ones weigh more) and the draft length it pays to verify."""

    def __init__(
        self, max_draft: int = MAX_DRAFT, decay: float = 0.95, prior: tuple[float, float] = (0.5, 1.5)
    ):
        self.max_draft = max_draft
        self.decay = decay
        self._accepted, self._proposed = prior  # a pseudo-count prior: acceptance 0.25 until observed

    def observe(self, accepted: bool) -> None:
        self._accepted = self._accepted * self.decay + float(accepted)
        self._proposed = self._proposed * self.decay + 1.0

    @property
    def acceptance(self) -> float:
        return self._accepted / self._proposed

    def draft_length(self, row_cost: float, limit: int) -> int:
        """argmax over k of expected tokens per pass over the pass's cost (k = 0: no drafting)."""
        a = self.acceptance
        best_k, best = 0, 1.0
        for k in range(1, min(self.max_draft, limit) + 1):
            rate = expected_tokens(a, k) / (1.0 + row_cost * k)
            if rate > best * 1.02:  # a margin: a draft must clearly pay for its pass
                best_k, best = k, rate
        return best_k


@dataclass
class Pending:
    """A verification pass's drafted tokens and logits rows: rows[i] follows draft[:i]."""

    draft: list[int]
    rows: np.ndarray  # [len(draft) + 1, vocab]
    used: int = 0  # drafted tokens accepted so far


class Speculation:
    """One generation's speculative state: proposals, the acceptance estimate, the pending verified rows."""

    def __init__(
        self,
        sampler: Sampler,
        cost: RowCost,
        *,
        max_draft: int = MAX_DRAFT,
        drafter: NgramDrafter | None = None,
    ) -> None:
        self.sampler = sampler
        self.cost = cost
        self.drafter = drafter or NgramDrafter()
        self.policy = DraftPolicy(max_draft)
        self.pending: Pending | None = None
        self.drafted = 0
        self.accepted = 0

    def sample(
        self, logits: np.ndarray, history: Sequence[int], allowed: np.ndarray | None = None
    ) -> tuple[int, float | None, TopLogprobs | None]:
        """The next token, from the logits for the position after `history`, among the `allowed` ones: the
        sampler's own draw (Sampler.sample), so the reply is the plain one; the proposal for this
        position, accepted when it is the token drawn, only feeds the acceptance estimate."""
        proposal = self.drafter.propose(history)
        token, logprob, top = self.sampler.sample(logits, history, allowed)
        if proposal is not None:
            self.policy.observe(token == proposal)
        return token, logprob, top

    def next_row(self, token: int) -> np.ndarray | None:
        """The logits after `token` when it was a pending drafted token (no pass needed), else None and the
        rest of the draft is dropped."""
        p = self.pending
        if p is not None and p.used < len(p.draft) and p.draft[p.used] == token:
            p.used += 1
            self.accepted += 1
            return p.rows[p.used]
        self.pending = None
        return None

    def drop(self) -> None:
        self.pending = None

    def draft(self, history: Sequence[int], limit: int) -> list[int]:
        """The tokens to verify after the history's last token (empty: a plain decode step)."""
        k = self.policy.draft_length(self.cost.c, limit)
        return self.drafter.draft(history, k) if k > 0 else []

    def verified(self, draft: list[int], rows: np.ndarray, seconds: float) -> None:
        self.cost.observe(len(draft) + 1, seconds)
        self.drafted += len(draft)
        self.pending = Pending(draft, rows) if draft else None

    def keep_rows(self) -> None:
        """The pending rows are a view of the session's logits buffer, which its next pass overwrites: a
        reply alone uses them before its next pass, but where replies take turns (models/runtime/turns.py)
        another reply's pass comes first, so they are copied out."""
        if self.pending is not None:
            self.pending.rows = self.pending.rows.copy()


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one pass with k drafted tokens yields on average (the rejected position's or the bonus
    token included)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)
