"""Token log-probabilities in OpenAI chat's shape (the Responses API's output_text logprobs are the same)."""

from __future__ import annotations

from models.types import TokenEvent


def token_text(ev: TokenEvent) -> str:
    return ev.token_text if ev.token_text is not None else ev.text


def chat_logprobs(events: list[TokenEvent]) -> dict | None:
    if not events or all(ev.logprob is None for ev in events):
        return None
    content = []
    for ev in events:
        text = token_text(ev)
        tops = [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in ev.top_logprobs or ()
        ]
        content.append(
            {"token": text, "logprob": ev.logprob, "bytes": list(text.encode()), "top_logprobs": tops}
        )
    return {"content": content, "refusal": None}
