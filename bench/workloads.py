"""Fixed prompts for `simmer bench engine --workload chat|rewrite`.

`rewrite` is the on-device work where the reply copies its input: correct, rewrite, extract and summarize
with quotes, each over the same text of about 400 tokens (written for this benchmark). `chat` is open
questions whose replies copy little. Both are rendered with the model's chat template.
"""

from __future__ import annotations

TEXT = """\
Minutes of the Harbour Street Community Garden meeting, held on Tuesday 4 March in the library annex.

Present were Ada Okafor (chair), Tomas Lindqvist (treasurer), Priya Raman, Jonas Weber and eleven other
members. Ada opened the meeting at seven o'clock and thanked everyone for coming out in the rain.

Tomas reported that the garden ended the year with 1,240 euros in the bank. Most of it came from the
plant sale in September, which raised 860 euros, and from membership fees. The largest expense was the
new water tank, which cost 410 euros including delivery. Tomas said the tank has already paid for itself,
because the garden no longer pays for mains water between May and August.

Priya presented the plan for the spring. The raised beds along the east fence will be rebuilt, because
the wood has rotted through in several places. She asked for volunteers on the first two Saturdays of
April, from nine in the morning until noon. Jonas offered to bring his trailer to collect the timber from
the sawmill in Eastbrook. Priya also proposed that the beds nearest the gate be given to the primary
school, so that each class can grow its own vegetables. The members agreed to this without a vote.

There was a long discussion about the compost heap. Several neighbours have complained about the smell
in the summer. Jonas suggested moving the heap to the far corner behind the shed and covering it with a
wooden lid. Ada asked him to find out what a lid would cost and to report at the next meeting.

Finally, the members chose the date of the open day: Saturday 14 June, from ten until four. There will
be a seed swap, a tour of the garden for new members, and tea and cake in the greenhouse. Ada closed the
meeting at half past eight. The next meeting will be on Tuesday 1 April.
"""

# A few words misspelled on purpose, for the "correct" task.
TYPO_TEXT = (
    TEXT.replace("thanked", "thankd")
    .replace("because", "becuase", 1)
    .replace("volunteers", "volunters")
    .replace("complained", "complaned")
    .replace("greenhouse", "grenhouse")
)

REWRITE_TASKS = {
    "correct": "Correct the spelling mistakes in the following text. Reply with the corrected text only.\n\n"
    + TYPO_TEXT,
    "rewrite": "Rewrite the following meeting minutes as a friendly email to the members who could not "
    "come. Keep every fact.\n\n" + TEXT,
    "extract": "From the following minutes, list every decision and every task, each with the person "
    "responsible, quoting the sentence it comes from.\n\n" + TEXT,
    "summarize": "Summarize the following minutes in five bullet points. Quote the exact sentence from the "
    "text that supports each point.\n\n" + TEXT,
}

CHAT_TASKS = {
    "explain": "Explain why the sky is blue to a ten-year-old.",
    "story": "Write a short story about a lighthouse keeper who finds a lost cat.",
    "advice": "I have a job interview tomorrow for a bakery. How should I prepare?",
    "compare": "What are the differences between a bicycle and a motorbike?",
}

WORKLOADS = {"chat": CHAT_TASKS, "rewrite": REWRITE_TASKS}


def workload_prompts(model_dir, workload: str) -> dict[str, list[int]]:
    """Each task's prompt as token ids, rendered with the model's chat template (raw text for a base
    model)."""
    from pathlib import Path

    from models.runtime.chat import ChatTemplate
    from models.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(Path(model_dir))
    out = {}
    for name, text in WORKLOADS[workload].items():
        if tokenizer.chat_template:
            rendered = ChatTemplate.from_tokenizer(tokenizer).render([{"role": "user", "content": text}])
            out[name] = tokenizer.encode(rendered, add_special_tokens=False)
        else:
            out[name] = tokenizer.encode(text, add_special_tokens=True)
    return out
