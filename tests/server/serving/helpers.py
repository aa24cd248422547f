"""Summary tests' helpers: text-only sampling and a long conversation to truncate."""

from __future__ import annotations

from models.types import SamplingParams

# The tiny random model prints only newlines greedily (a blank summary), or bytes that are no text: the
# summarizer's sampling bans them (the tiny vocabulary's byte b is token 3 + b), so it writes ASCII.
TEXT_ONLY = SamplingParams(
    temperature=0.0, logit_bias=tuple((3 + b, -100.0) for b in [*range(0, 32), *range(127, 256)])
)


def conversation(turns: int = 10, size: int = 40) -> list[dict]:
    """A system message, `turns` alternating user/assistant turns of about `size` characters (the tiny
    vocabulary is about a token per character: far more than a 256-token context) and a last question."""
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"turn {i}: " + "the cat sat on a mat " * (size // 20)})
    messages.append({"role": "user", "content": "and now?"})
    return messages
