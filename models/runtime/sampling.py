"""Choosing the next token from logits: pure numpy, the RNG passed in.

The pipeline, in order (llama.cpp's default sampler chain for these steps; Hugging Face's order):

1. logit_bias (OpenAI): each listed token's logit += its bias (-100..100). A bias of -100 bans the token
   and +100 forces it for any real model (logits span far less than 100); with greedy too.
2. penalties on a copy of the logits (only when any is active):
   - repetition_penalty r (HF / llama.cpp / CTRL style) over every token in the history, prompt
     included: a positive logit is divided by r, a negative one multiplied by r;
   - presence_penalty and frequency_penalty (OpenAI style) over GENERATED tokens only, as vLLM does:
     logit -= frequency * count + presence * (count > 0). Penalising the prompt would punish a reply
     for quoting the question.
3. temperature below GREEDY_BELOW (0 included): greedy, argmax of the adjusted logits. Otherwise:
4. (logits - max) / temperature, then top_k, then top_p (nucleus over the distribution renormalised
   after top_k), then min_p (keep p >= min_p * p_max), then one draw from the survivors.

Total over every value `validate` accepts and over any logits: NaN logits never win, +inf logits share
the mass equally, all -inf is uniform, and overflow (a huge logit divided by a small penalty) lands on
+inf and is handled the same way. So `sample` always returns an id in [0, vocabulary).

5. A constraint (structured output, tool calls: models/runtime/constraint.py) passes `allowed`, a boolean
   mask over the vocabulary. It applies after step 2 and before 3: the candidates are the allowed tokens
   only, and greedy, top_k, top_p and min_p all work on the distribution renormalised over them (vLLM and
   llama.cpp order the grammar first too). Sanitising (below) happens among the allowed tokens, so even
   NaN or -inf logits never let a disallowed token through.

Logprobs follow OpenAI: the log-softmax of the raw model logits (before bias, penalties and
temperature), for the chosen token and the top `logprobs` alternatives; floored at -9999 as OpenAI does,
so an impossible token still has a JSON number. Under a constraint they still report the model's own
distribution (vLLM's default, raw logprobs): a forced token shows how much the model wanted it, and the
top alternatives may include tokens the grammar did not allow.

One Sampler per generation: `history` must only grow by appending between calls (penalty counts are
updated incrementally). The history of the first call is taken as the prompt unless prompt_len is given.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from models.errors import InvalidParameter
from models.types import SamplingParams

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
# Temperatures below this are greedy, as in vLLM (_SAMPLING_EPS): the distribution is already all on the
# argmax to float precision, and 1/temperature would overflow for the tiniest values.
GREEDY_BELOW = 1e-5
# The repetition penalty divides (or multiplies) logits. 0.01 rewards repetition exactly as strongly as
# 100 punishes it; smaller values are refused rather than clamped, so no request is silently changed.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0  # OpenAI: -100..100
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # OpenAI's seed is an int64
LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token with no probability

TopLogprobs = tuple[tuple[int, float], ...]


def make_rng(seed: int | None) -> np.random.Generator:
    """Same seed, same draws; None seeds from the OS. Every int64 is an ordinary seed: negative ones are
    taken modulo 2**64 (two's complement), so -1 is as reproducible as 1. llama.cpp reads -1 as "random";
    simmer follows OpenAI, where seed is any integer and reproducibility is the point of sending one.
    Leave seed out (or null) for a fresh draw."""
    return np.random.default_rng(None if seed is None else seed % 2**64)


def validate(params: SamplingParams, vocab_size: int | None = None) -> None:
    """Raise InvalidParameter (naming the field) for values outside the accepted ranges. With
    `vocab_size`, logit_bias ids must be in the vocabulary."""
    r = params.repetition_penalty
    checks = [
        ("temperature", 0.0 <= params.temperature <= 2.0, "between 0 and 2"),
        ("top_p", 0.0 <= params.top_p <= 1.0, "between 0 and 1"),
        ("top_k", params.top_k >= 0, "0 (off) or positive"),
        ("min_p", 0.0 <= params.min_p <= 1.0, "between 0 and 1"),
        (
            "repetition_penalty",
            MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY,
            f"between {MIN_REPETITION_PENALTY} and {MAX_REPETITION_PENALTY:g}",
        ),
        ("presence_penalty", -2.0 <= params.presence_penalty <= 2.0, "between -2 and 2"),
        ("frequency_penalty", -2.0 <= params.frequency_penalty <= 2.0, "between -2 and 2"),
        (
            "logprobs",
            params.logprobs is None or 0 <= params.logprobs <= MAX_TOP_LOGPROBS,
            f"between 0 and {MAX_TOP_LOGPROBS}",
        ),
        ("seed", params.seed is None or SEED_MIN <= params.seed <= SEED_MAX, "a 64-bit signed integer"),
    ]
    for name, ok, what in checks:
        if not ok:  # NaN fails every comparison, so it lands here too
            raise InvalidParameter(f"{name} must be {what}, got {getattr(params, name)!r}", param=name)
    for token, bias in params.logit_bias:
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidParameter(
                f"logit_bias values must be between -100 and 100, got {bias!r} for token {token}",
                param="logit_bias",
            )
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            top = f" (0..{vocab_size - 1})" if vocab_size is not None else ""
            raise InvalidParameter(
                f"logit_bias key {token} is not a token id of this model's vocabulary{top}",
                param="logit_bias",
            )


def _sanitized(x: np.ndarray) -> np.ndarray:
    """`x` itself when its maximum is finite (the pipeline copes with -inf); otherwise a copy where NaN
    never wins and the +inf tokens (or, with none finite, all tokens) share the mass equally."""
    top = x.max()
    if np.isfinite(top):
        return x
    x = np.where(np.isnan(x), np.float32(-np.inf), x).astype(np.float32, copy=False)
    top = x.max()
    if top == np.inf:
        return np.where(x == np.inf, np.float32(0.0), np.float32(-np.inf)).astype(np.float32, copy=False)
    if top == -np.inf:
        return np.zeros_like(x)
    return x


def greedy_index(x: np.ndarray) -> int:
    """argmax(_sanitized(x)) in one pass over `x` when its maximum is finite (every real model's logits):
    np.argmax stops at the first NaN and picks +inf when there is one, so a finite value at the argmax
    means the maximum is finite and _sanitized would have returned `x` itself. The second pass of that
    check (x.max()) cost ~40 % of a greedy token's sampling over Gemma 3's 262,144 logits."""
    i = int(np.argmax(x))
    if np.isfinite(x[i]):
        return i
    return int(np.argmax(_sanitized(x)))


def draw(ids: np.ndarray | None, probs: np.ndarray, u: float) -> int:
    """The token at uniform `u` in [0, 1) of the (ids, probs) distribution (inverse CDF; probabilities
    need not sum to exactly 1)."""
    cdf = np.cumsum(probs, dtype=np.float64)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    i = min(i, len(cdf) - 1)  # guards against rounding at the very top
    return int(i if ids is None else ids[i])


class Sampler:
    def __init__(
        self,
        params: SamplingParams,
        rng: np.random.Generator,
        *,
        prompt_len: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        validate(params, vocab_size)
        self.params = params
        self._vocab_checked = vocab_size is not None
        bias = dict(params.logit_bias)  # a repeated id: the last value wins, as in a JSON object
        self._bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self._bias_vals = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        self.rng = rng
        self._prompt_len = prompt_len
        self._seen_n = 0  # how much of the history has been counted
        self._seen: set[int] = set()  # every token in the history (repetition penalty)
        self._seen_arr = np.empty(0, dtype=np.int64)
        self._counts: dict[int, int] = {}  # generated tokens only (presence / frequency)
        self._count_ids = np.empty(0, dtype=np.int64)
        self._count_vals = np.empty(0, dtype=np.float32)
        self._repetition = params.repetition_penalty != 1.0
        self._additive = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0

    # -- penalties -----------------------------------------------------------------------------------

    def _observe(self, history: Sequence[int]) -> None:
        n = len(history)
        if self._prompt_len is None:
            self._prompt_len = n
        if n < self._seen_n:  # not an append: start over rather than count wrongly
            self._seen_n = 0
            self._seen.clear()
            self._counts.clear()
        if n == self._seen_n:
            return
        new = history[self._seen_n : n]
        if self._repetition:
            before = len(self._seen)
            self._seen.update(int(t) for t in new)
            if len(self._seen) != before:
                self._seen_arr = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
        if self._additive:
            start = max(self._prompt_len - self._seen_n, 0)
            for t in new[start:]:
                self._counts[int(t)] = self._counts.get(int(t), 0) + 1
            if self._counts:
                self._count_ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
                self._count_vals = np.fromiter(
                    self._counts.values(), dtype=np.float32, count=len(self._counts)
                )
        self._seen_n = n

    def penalize(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The logits after logit_bias and penalties: the input itself when none is active, else a new
        array (which may hold +-inf where a huge logit overflowed; `_sanitized` deals with that)."""
        if not (self._repetition or self._additive or self._bias_ids.size):
            return logits
        self._observe(history)
        out = np.array(logits, dtype=np.float32, copy=True)
        if self._bias_ids.size:
            out[self._bias_ids] += self._bias_vals
        if self._repetition and self._seen_arr.size:
            r = np.float32(self.params.repetition_penalty)
            sel = out[self._seen_arr]
            out[self._seen_arr] = np.where(sel > 0, sel / r, sel * r)
        if self._additive and self._count_ids.size:
            p = self.params
            out[self._count_ids] -= np.float32(p.frequency_penalty) * self._count_vals + np.float32(
                p.presence_penalty
            )
        return out

    # -- sampling ------------------------------------------------------------------------------------

    def sample(
        self, logits: np.ndarray, history: Sequence[int], allowed: np.ndarray | None = None
    ) -> tuple[int, float | None, TopLogprobs | None]:
        """Pick the next token from 1-D float32 `logits` over the vocabulary, among the `allowed` ones
        (a boolean mask as long as the vocabulary, or None for all; at least one must be allowed).
        Returns (token id, its logprob under the model, top alternatives); both logprob parts are None
        unless params.logprobs is set (a log-softmax over the vocabulary costs ~0.1 ms a token). The
        alternatives are (id, logprob) pairs, best first."""
        self._check_vocab(logits)
        # Overflow to +-inf and inf - inf are expected on extreme inputs and handled by _sanitized.
        with np.errstate(over="ignore", invalid="ignore", under="ignore", divide="ignore"):
            ids, x = self._masked(logits, history, allowed, sanitize=not self.greedy)
            if self.greedy:
                token = greedy_index(x)
            else:
                sub, probs = self._probs(x)
                token = draw(sub, probs, self.rng.random())
            if ids is not None:
                token = int(ids[token])
        return (token, *self.logprobs(logits, token))

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_BELOW or self.params.top_k == 1

    def distribution(
        self, logits: np.ndarray, history: Sequence[int], allowed: np.ndarray | None = None
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """The whole sampling distribution `sample` draws from, after logit_bias, penalties, the `allowed`
        mask, temperature, top_k, top_p and min_p: (token ids, or None for the whole vocabulary in id
        order; their probabilities, which sum to 1 up to rounding). Greedy is a point mass on the argmax.
        Tests check a speculated reply's frequencies against it, so anything that changes what `sample`
        may pick belongs in this pipeline, not after it."""
        self._check_vocab(logits)
        with np.errstate(over="ignore", invalid="ignore", under="ignore", divide="ignore"):
            ids, x = self._masked(logits, history, allowed, sanitize=not self.greedy)
            if self.greedy:
                top = greedy_index(x)
                return np.array([top if ids is None else ids[top]], np.int64), np.ones(1, np.float32)
            sub, probs = self._probs(x)
            if ids is not None:
                sub = ids if sub is None else ids[sub]
            return sub, probs

    def _masked(
        self, logits: np.ndarray, history: Sequence[int], allowed: np.ndarray | None, sanitize: bool = True
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """(the allowed token ids, or None for all; their penalized logits, sanitized unless told not to:
        greedy_index sanitizes only when it must). The mask goes before _sanitized, so a NaN or inf among
        the disallowed tokens cannot reach the allowed ones."""
        x = self.penalize(logits, history)
        ids: np.ndarray | None = None
        if allowed is not None:
            ids = np.flatnonzero(allowed[: x.shape[-1]])
            if ids.size == 0:
                raise ValueError("the constraint allows no token")
            x = x[ids]
        return ids, _sanitized(x) if sanitize else x

    def logprobs(self, logits: np.ndarray, token: int) -> tuple[float | None, TopLogprobs | None]:
        """(logprob, top alternatives) of `token` under the raw logits, both None unless asked for."""
        if self.params.logprobs is None:
            return None, None
        with np.errstate(over="ignore", invalid="ignore", under="ignore", divide="ignore"):
            return self._logprobs(logits, token)

    def _check_vocab(self, logits: np.ndarray) -> None:
        if not self._vocab_checked:  # the vocabulary is the logits' length
            validate(self.params, logits.shape[-1])
            self._vocab_checked = True

    def _probs(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        p = self.params
        ids: np.ndarray | None = None  # None: candidates are the whole vocabulary
        if 0 < p.top_k < x.shape[-1]:
            ids = np.argpartition(x, -p.top_k)[-p.top_k :]
            x = x[ids]
        # Subtract the max before scaling: x * (1/t) alone overflows for large logits. A new array, so the
        # caller's logits stay untouched.
        z = (x - x.max()) * np.float32(1.0 / p.temperature)
        np.exp(z, out=z)
        z /= z.sum()
        probs = z
        # Survivors of top_p and min_p are both prefixes of the tokens sorted by probability, so the
        # result is the shorter prefix. min_p's threshold is relative to p_max, which the later
        # renormalisation does not change, so both filters read the same distribution.
        if p.min_p > 0.0:
            keep = np.flatnonzero(probs >= p.min_p * probs.max())
            ids = keep if ids is None else ids[keep]
            probs = probs[keep]
        if p.top_p < 1.0:
            order = self._top_p_order(probs, p.top_p)
            ids = order if ids is None else ids[order]
            probs = probs[order]
        return ids, probs

    @staticmethod
    def _top_p_order(probs: np.ndarray, top_p: float) -> np.ndarray:
        """Indices of the smallest set of most likely tokens whose mass reaches top_p, best first.
        Sorts only a growing head of the distribution (argpartition), not the whole vocabulary."""
        n = probs.shape[0]
        k = min(64, n)
        while True:
            head = np.argpartition(probs, n - k)[n - k :] if k < n else np.arange(n)
            head = head[np.argsort(-probs[head], kind="stable")]
            cum = np.cumsum(probs[head], dtype=np.float64)
            # Keep tokens up to and including the one that reaches top_p (at least one). The epsilon
            # lets float32 sums such as 0.5 + 0.3 count as reaching 0.8.
            cut = int(np.searchsorted(cum, top_p - 1e-6, side="left")) + 1
            if cut <= k or k == n:
                return head[: min(cut, k)]
            k = min(k * 4, n)

    def _logprobs(self, logits: np.ndarray, token: int) -> tuple[float, TopLogprobs | None]:
        x = _sanitized(logits)
        m = float(x.max())
        lse = m + float(np.log(np.exp(x - m, dtype=np.float32).sum(dtype=np.float64)))

        def lp(i: int) -> float:
            return max(float(x[i]) - lse, LOGPROB_FLOOR)

        k = self.params.logprobs
        if k is None:
            return lp(token), None
        if k == 0:
            return lp(token), ()
        k = min(k, x.shape[-1])
        top = np.argpartition(x, -k)[-k:]
        top = top[np.argsort(-x[top], kind="stable")]
        return lp(token), tuple((int(i), lp(int(i))) for i in top)
