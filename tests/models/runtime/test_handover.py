"""A reply handed from one model to another mid-way (the governor's rung moved to another model).

Same tokenizer (two sizes of one family): the next model continues from the same token ids, its KV cache
built once from the context. Another tokenizer (byte-level BPE -> SentencePiece): the text so far is
tokenized again by the next model, and what the client reads stays one continuous text.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from models.protocol import EngineLimits
from models.runtime.engine import DecoderEngine, load_engine
from models.runtime.reply import ReplyState
from models.runtime.tokenizer import IncrementalDetokenizer, Tokenizer
from models.types import FinishEvent, GenerationParams, Handover, SamplingParams, TokenEvent

PROMPT = "The quick brown fox"
N = 20


def engines(*dirs) -> list[DecoderEngine]:
    return [load_engine(d, variant="f32", threads=1, context_length=128) for d in dirs]


def switch_after(k: int, target: str) -> tuple[object, list[int]]:
    """A step hook that names `target` once k tokens are out (the decode checkpoint after token k)."""
    emitted = [0]

    def hook() -> EngineLimits | None:
        return EngineLimits(model_id=target) if emitted[0] >= k else None

    return hook, emitted


def run(events: Iterator, emitted: list[int] | None = None) -> tuple[list[TokenEvent], object]:
    tokens: list[TokenEvent] = []
    for event in events:
        if isinstance(event, TokenEvent):
            tokens.append(event)
            if emitted is not None:
                emitted[0] += 1
        else:
            return tokens, event
    raise AssertionError("no final event")


def alone(engine: DecoderEngine, prompt_ids: list[int], params: GenerationParams) -> list[TokenEvent]:
    from models.protocol import Prompt

    tokens, _ = run(engine.generate(Prompt(list(prompt_ids)), params))
    return tokens


def test_handover_when_same_tokenizer_then_same_ids_continue_and_kv_built_once(tiny_pair_dirs):
    big, small = engines(*tiny_pair_dirs)
    ref_big, ref_small = engines(*tiny_pair_dirs)
    assert big.tokenizer_key == small.tokenizer_key
    params = GenerationParams(SamplingParams(temperature=0), max_tokens=N, ignore_eos=True)
    prompt = big.text_prompt(PROMPT)
    k = 7
    hook, emitted = switch_after(k, small.model_id)

    first, handover = run(big.generate(prompt, params, step_hook=hook), emitted)
    assert isinstance(handover, Handover)
    assert handover.model_id == small.model_id and handover.generated == k and len(first) == k
    before = small.positions_run
    rest, finish = run(small.generate(None, params, resume=handover))

    assert isinstance(finish, FinishEvent) and finish.model_id == small.model_id
    ids = [t.token_id for t in first + rest]
    expected_first = [t.token_id for t in alone(ref_big, prompt.ids, params)[:k]]
    expected_rest = [
        t.token_id for t in alone(ref_small, prompt.ids + expected_first, replace_max(params, N - k))
    ]
    assert ids == expected_first + expected_rest  # what each model alone writes from that context
    assert [t.index for t in first + rest] == list(range(N))
    # the KV cache of the new model: the whole context once, then one position per decoded token
    assert small.positions_run - before == len(prompt.ids) + k + (N - k - 1)
    assert finish.usage.by_model == {big.model_id: k, small.model_id: N - k}
    assert finish.usage.completion_tokens == N and finish.usage.prompt_tokens == len(prompt.ids)


def replace_max(params: GenerationParams, n: int) -> GenerationParams:
    from dataclasses import replace

    return replace(params, max_tokens=n)


def holds_bytes(tok: Tokenizer, ids: list[int]) -> bool:
    detok = IncrementalDetokenizer(tok)
    for i in ids:
        detok.feed(i)
    return detok.flush() != ""


def held_byte_token(tok: Tokenizer, byte: int) -> int:
    return next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == bytes([byte]))


def test_handover_when_another_tokenizer_then_text_goes_on_without_loss_or_repeat(
    tiny_pair_dirs, tiny_spm_dir
):
    (big,) = engines(tiny_pair_dirs[0])
    (spm,) = engines(tiny_spm_dir)
    (ref,) = engines(tiny_pair_dirs[0])
    assert big.tokenizer_key != spm.tokenizer_key
    assert (big.tokenizer.kind, spm.tokenizer.kind) == ("byte_level", "sentencepiece")
    # A nudge towards the lead byte of a 3-byte UTF-8 character: once the model writes it, the detokenizer
    # holds a byte that never becomes a character.
    lead = held_byte_token(big.tokenizer, 0xE4)
    params = GenerationParams(
        SamplingParams(temperature=1.0, seed=0, logit_bias=((lead, 10.0),)), max_tokens=N, ignore_eos=True
    )
    prompt = big.text_prompt(PROMPT)
    reference = alone(ref, prompt.ids, params)
    ids = [t.token_id for t in reference]
    # switch where the detokenizer holds part of a character
    k = next(k for k in range(3, N - 4) if holds_bytes(big.tokenizer, ids[:k]))
    # and a stop string that starts with the reply's last two characters: held by the stop matcher then
    shown = "".join(t.text for t in reference[:k])
    params = replace_stop(params, shown[-2:] + "\x00never")
    hook, emitted = switch_after(k, spm.model_id)

    first, handover = run(big.generate(prompt, params, step_hook=hook), emitted)
    assert isinstance(handover, Handover) and handover.generated == k
    assert handover.text == shown  # complete characters only: the held-back bytes are not in it
    assert "".join(t.text for t in first) == shown[:-2]  # the last two wait in the stop matcher
    continuation = spm.continuation_prompt(PROMPT, handover.text)
    assert spm.tokenizer.decode(continuation.ids) == PROMPT + shown  # the next model reads the text so far
    rest, finish = run(spm.generate(continuation, params, resume=handover))

    client = "".join(t.text for t in first + rest) + finish.text
    assert client.startswith(shown)  # nothing lost: the held text came out once, after the switch
    after = client[len(shown) :]
    spm_text = spm.tokenizer.decode([t.token_id for t in rest])
    assert after == spm_text  # nothing repeated: the rest is exactly what the new model wrote
    assert [t.index for t in first + rest] == list(range(N))
    assert finish.usage.by_model == {big.model_id: k, spm.model_id: N - k}


def replace_stop(params: GenerationParams, stop: str) -> GenerationParams:
    from dataclasses import replace

    return replace(params, stop=(stop,))


def test_reply_state_when_retokenized_then_held_bytes_dropped_and_stop_hold_kept(
    tiny_pair_dirs, tiny_spm_dir
):
    big_tok, spm_tok = Tokenizer.load(tiny_pair_dirs[0]), Tokenizer.load(tiny_spm_dir)
    params = GenerationParams(stop=("é!",))
    state = ReplyState.start(params, big_tok, "bpe", [1, 2, 3], truncated=False)
    for token in [*big_tok.encode("café"), held_byte_token(big_tok, 0xE4)]:
        piece = state.detok.feed(token)
        state.text.append(piece)
        state.stops.feed(piece)
    assert state.reply_text == "café"  # the lead byte of a 3-byte character is held, not text yet
    state.retokenized(spm_tok, "spm", spm_tok.encode("x café"), reply_tokens=3)
    assert state.detok.flush() == ""  # the held byte went with the old vocabulary: never shown
    delta, hit = state.stops.feed("!")  # the held "é" is still the stop matcher's
    assert hit and delta == "" and state.stops.matched == "é!"
    assert state.tokenizer_key == "spm" and state.history == state.ctx == spm_tok.encode("x café")


@pytest.mark.parametrize("chat", [False, True])
def test_continuation_prompt_when_request_then_own_rendering_then_reply_as_literal_text(tiny_spm_dir, chat):
    (spm,) = engines(tiny_spm_dir)
    request = [{"role": "user", "content": "hi"}] if chat else "Once upon"
    reply = " a time <start_of_turn>"  # a special token's text inside the reply stays text
    prompt = spm.continuation_prompt(request, reply)
    head = spm.chat_prompt(request).ids if chat else spm.text_prompt(request).ids
    assert prompt.ids[: len(head) - 1] == head[: len(head) - 1]
    start_of_turn = spm.tokenizer.token_to_id("<start_of_turn>")
    assert prompt.ids[len(head) :].count(start_of_turn) == 0
    assert spm.tokenizer.decode(prompt.ids).endswith(reply)
    assert prompt.reply_tokens == len(prompt.ids) - len(head) and not prompt.truncated
