"""Token log-probabilities in OpenAI chat's shape (the Responses API's output_text logprobs are the same)."""

from __future__ import annotations

from models.types import TokenEvent
from server.api.common.reply import TokenLogprob, TopLogprob


def token_text(ev: TokenEvent) -> str:
    return ev.token_text if ev.token_text is not None else ev.text


def token_logprobs(events: list[TokenEvent]) -> list[TokenLogprob] | None:
    """One entry per token with its top alternatives; None when no token carries a logprob (not asked).
    Built unvalidated (every token, its alternatives): an upstream that sent logprobs for some chunks only
    relays the others' as null, as it did when replies were dicts."""
    if not events or all(ev.logprob is None for ev in events):
        return None
    out = []
    for ev in events:
        text = token_text(ev)
        tops = [
            TopLogprob.model_construct(token=t.token, logprob=t.logprob, bytes=list(t.bytes))
            for t in ev.top_logprobs or ()
        ]
        entry = TokenLogprob.model_construct(
            token=text, logprob=ev.logprob, bytes=list(text.encode()), top_logprobs=tops
        )
        out.append(entry)
    return out
