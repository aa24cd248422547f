"""A fixed set of varied English sentences for the embedding benchmark, made from a seed (no download, the
same list on every machine): short statements, questions, instructions, sentences with numbers and
punctuation, and long ones of several clauses, so the batches hold rows of different lengths (an encoder
pads a batch to its longest row, or packs its rows: either way the spread of lengths is part of the cost).
"""

from __future__ import annotations

import random

SEED = 20261207

_SUBJECTS = [
    "the engineer",
    "a small robot",
    "my grandmother",
    "the city council",
    "our neighbour's dog",
    "the night nurse",
    "a tired student",
    "the old lighthouse keeper",
    "the delivery driver",
    "a group of volunteers",
    "the software team",
    "the orchestra",
    "a curious child",
    "the museum guide",
    "the baker on the corner",
    "a retired pilot",
]
# (base, past) forms
_VERBS = [
    ("repair", "repaired"),
    ("paint", "painted"),
    ("describe", "described"),
    ("carry", "carried"),
    ("measure", "measured"),
    ("forget", "forgot"),
    ("translate", "translated"),
    ("order", "ordered"),
    ("photograph", "photographed"),
    ("clean", "cleaned"),
    ("sell", "sold"),
    ("borrow", "borrowed"),
    ("test", "tested"),
    ("build", "built"),
]
_OBJECTS = [
    "the broken bicycle",
    "a map of the coastline",
    "three boxes of apples",
    "the quarterly budget",
    "an umbrella with a bent handle",
    "the kitchen window",
    "a letter from the bank",
    "the wiring in the attic",
    "a recipe for lemon cake",
    "the train timetable",
    "a pair of hiking boots",
    "the results of the survey",
    "the server logs",
    "a jar of honey",
]
_PLACES = [
    "in the garden",
    "at the station",
    "near the river",
    "on the third floor",
    "behind the library",
    "in a crowded market",
    "at the edge of town",
    "inside the warehouse",
    "on the night train",
    "in the school hall",
]
_TIMES = [
    "yesterday",
    "last winter",
    "before breakfast",
    "on Monday morning",
    "after the storm",
    "in 1987",
    "every other week",
    "at half past six",
    "during the holidays",
    "late at night",
]
_ADVERBS = ["quietly", "carefully", "reluctantly", "quickly", "proudly", "twice", "almost", "suddenly"]
_REASONS = [
    "the forecast promised heavy rain",
    "nobody else had the right tools",
    "the deadline had moved to Friday",
    "the instructions were written in German",
    "the price had dropped by 40%",
    "the power had been cut for hours",
    "it seemed like the kind thing to do",
]
_CONSEQUENCES = [
    "surprised everyone at the meeting",
    "saved the company about $1,200",
    "made the evening news",
    "meant the bus left without them",
    "started a long argument about fairness",
    "turned out to be a mistake",
]
_PLURALS = ["tickets", "chairs", "emails", "patients", "bottles", "questions", "seedlings", "invoices"]
_PARTICIPLES = ["counted", "stored", "answered", "lost", "delivered", "checked", "returned", "sorted"]


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _sentence(r: random.Random) -> str:
    subj, subj2 = r.sample(_SUBJECTS, 2)
    (base, past), (base2, past2) = r.sample(_VERBS, 2)
    obj, obj2 = r.sample(_OBJECTS, 2)
    place, time, adverb = r.choice(_PLACES), r.choice(_TIMES), r.choice(_ADVERBS)
    forms = [
        f"{_cap(subj)} {past} {obj}.",
        f"{_cap(subj)} {adverb} {past} {obj} {place} {time}.",
        f"Why did {subj} {base} {obj} {time}?",
        f"Should {subj2} {base2} {obj2} {place}, or wait until {time}?",
        f"Please {base} {obj} before {subj} arrives.",
        f"{r.randint(2, 950)} {r.choice(_PLURALS)} were {r.choice(_PARTICIPLES)} {place} {time}.",
        f"{_cap(time)}, {subj} {past} {obj}, and {subj2} {past2} {obj2} {place}.",
        f"Note: {subj} must not {base} {obj} unless {subj2} has {past2} it first.",
        f"Although {subj} {past} {obj} {place}, {subj2} {adverb} {past2} {obj2} because "
        f"{r.choice(_REASONS)}, which {r.choice(_CONSEQUENCES)}.",
        f'"Can you {base} {obj}?" asked {subj}; {subj2} said no, {r.choice(_REASONS)}.',
        f"{_cap(subj)} {past} {obj} {place} {time} because {r.choice(_REASONS)}; later, {subj2} "
        f"{past2} {obj2} as well, which {r.choice(_CONSEQUENCES)}, and nobody asked why.",
    ]
    return r.choice(forms)


def sentences(n: int, seed: int = SEED) -> list[str]:
    """`n` distinct sentences, the same for the same `n` and seed."""
    r = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        s = _sentence(r)
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out
