"""Embeddings through the upstream: one POST of OpenAI's /v1/embeddings body, its JSON answer read bounded
and checked, then handed back as the worker's own answer (`Embedded`), which each dialect renders.

Translated once each way: the inputs (strings, or rows of token ids) become OpenAI's body here, and the
upstream's OpenAI list becomes the vectors and the usage here; no dialect sees the upstream's JSON.

What leaves the device: the model name the upstream knows, the inputs, and `dimensions` when the client
set it (an upstream-only model may be one that can be shortened). Never `user`, `encoding_format` (the
upstream answers floats, its default everywhere; the client's encoding is applied here), Ollama's
`keep_alive`/`truncate`/`options` or llama.cpp's `embd_normalize` (applied here to what comes back).

An upstream is trusted with nothing (docs/routing.md): its answer is read to at most `answer_cap` bytes,
must come whole within the timeout, and must be one finite vector of one width per input, each index once;
anything else is a bad_response (502 upstream_error, never a 500). Parsing a large answer is a thread's work.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np

from models.errors import SimmerError
from server.refusals import UpstreamError
from server.routing.relay import MAX_COUNT
from server.routing.upstream import UpstreamClient, UpstreamFailure, to_simmer_error
from server.serving.embedding import Embedded

PATH = "/embeddings"
# The widest vector accepted from an upstream whose model is not installed here (whose width is unknown):
# above the widest common embedding models (OpenAI's text-embedding-3-large 3072, e5-mistral 4096).
MAX_DIMENSIONS = 8192
# A float as JSON writes it with its separator: "-1.2345678901234567e-308, " is 26 bytes.
FLOAT_BYTES = 26
ROW_BYTES = 256  # a row's own JSON around its floats ({"object": "embedding", "index": 255, ...})
SLACK_BYTES = 64 << 10  # the list's own fields: model, usage, an upstream's extras


def answer_cap(rows: int, width: int | None) -> int:
    """The most an upstream's answer may take for `rows` vectors of `width` (unknown: MAX_DIMENSIONS, which
    bounds a wider one too: parse_answer refuses it)."""
    return SLACK_BYTES + rows * (ROW_BYTES + min(width or MAX_DIMENSIONS, MAX_DIMENSIONS) * FLOAT_BYTES)


def embeddings_body(model: str, inputs: list[str] | list[list[int]], dimensions: int | None) -> dict:
    """OpenAI's /v1/embeddings body for the upstream."""
    body: dict[str, Any] = {"model": model, "input": list(inputs)}
    if dimensions is not None:
        body["dimensions"] = dimensions
    return body


def parse_answer(raw: bytes, rows: int, width: int | None) -> Embedded:
    """The upstream's OpenAI embedding list as the worker's answer: `rows` vectors in the inputs' order,
    all of `width` (None: any one width up to MAX_DIMENSIONS), every number finite as float32. Raises
    UpstreamFailure("bad_response") naming the first thing wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested beyond the parser
        raise _bad("the answer is not JSON") from None
    items = data.get("data") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise _bad("the answer has no `data` list")
    if len(items) != rows:
        raise _bad(f"{len(items)} vectors for {rows} inputs")
    placed: list[list | None] = [None] * rows
    for position, item in enumerate(items):
        index = item.get("index", position) if isinstance(item, dict) else None
        vector = item.get("embedding") if isinstance(item, dict) else None
        if not (isinstance(index, int) and not isinstance(index, bool) and 0 <= index < rows):
            raise _bad(f"data[{position}] has no index from 0 to {rows - 1}")
        if placed[index] is not None:
            raise _bad(f"two vectors for index {index}")
        if not isinstance(vector, list) or not vector:
            raise _bad(f"data[{position}].embedding is not a list of numbers")
        placed[index] = vector
    vectors = [v for v in placed if v is not None]
    want = width or len(vectors[0])
    if want > MAX_DIMENSIONS:
        raise _bad(f"{want}-dimensional vectors (at most {MAX_DIMENSIONS})")
    for index, vector in enumerate(vectors):
        if len(vector) != want:
            raise _bad(f"the vector for index {index} has {len(vector)} dimensions, not {want}")
        # bool is an int to Python and numpy; a string of digits would convert: neither is a number here
        if not all(type(x) is float or type(x) is int for x in vector):
            raise _bad(f"the vector for index {index} holds something other than numbers")
    try:
        array = np.array(vectors, dtype=np.float64)
    except (OverflowError, ValueError):  # an integer of 400 digits
        raise _bad("a vector holds a number out of range") from None
    with np.errstate(over="ignore"):
        out = array.astype(np.float32)
    if not np.isfinite(out).all():  # NaN, Infinity (Python's JSON reads both), 1e400, beyond float32
        raise _bad("a vector holds NaN, an infinity or a number beyond float32")
    return Embedded(out, _count(data.get("usage")))


def _count(usage: Any) -> int:
    """The upstream's prompt tokens, if it reports a count (else 0: unknown)."""
    value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT
    return value if ok else 0


def _bad(why: str) -> UpstreamFailure:
    return UpstreamFailure("bad_response", why)


async def fetch(
    client: UpstreamClient,
    body: dict,
    rows: int,
    width: int | None,
    *,
    timeout_s: float,
) -> Embedded:
    """POST `body` and read its answer: whole within `timeout_s` (an answer is one piece: its first byte
    is no progress, as a token is in a stream), at most answer_cap bytes, parsed off the event loop."""
    try:
        async with asyncio.timeout(timeout_s):
            raw = await client.answer(PATH, body, answer_cap(rows, width))
    except TimeoutError:
        raise UpstreamFailure("timeout", f"no answer in {timeout_s:g} s") from None
    return await asyncio.to_thread(parse_answer, raw, rows, width)


def embeddings_error(failure: UpstreamFailure, retry_in_s: float | None) -> SimmerError:
    """An upstream failure in simmer's vocabulary. An answer that came whole but is not usable (a wrong
    count, NaN, too big) is the upstream's fault and says so (502); the rest maps as a generation's would
    before its first token (503 with Retry-After, or the upstream's 4xx about the request)."""
    if failure.kind == "bad_response":
        return UpstreamError(f"The upstream's embeddings are not usable ({failure.describe()}).")
    return to_simmer_error(failure, mid_reply=False, retry_in_s=retry_in_s if retry_in_s else None)
