"""Constrained decoding on the tiny real model (random weights: left alone it writes noise, so whatever
parses below does so because of the mask) and on the constraint object itself."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from models.errors import InvalidParameter
from models.protocol import EngineLimits
from models.runtime.constraint import (
    Constraint,
    ConstraintFailed,
    ConstraintVocabulary,
    check_grammar,
    gbnf_grammar,
    json_schema_grammar,
)
from models.types import GenerationParams, SamplingParams
from tests.models.runtime.helpers import GREEDY, PERSON, run, text_of


def params(grammar: str | None, max_tokens: int = 200, **sampling) -> GenerationParams:
    return GenerationParams(SamplingParams(**sampling), max_tokens=max_tokens, grammar=grammar)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_constraint_when_sampled_then_output_is_valid_json_of_the_schema(tiny_decoder, seed):
    prompt = tiny_decoder.text_prompt("json please")
    tokens, fin = run(tiny_decoder, prompt, params(json_schema_grammar(PERSON), temperature=1.0, seed=seed))
    assert fin.finish_reason == "stop"
    jsonschema.validate(json.loads(text_of(tokens, fin)), PERSON)


def test_constraint_when_absent_then_tiny_model_writes_no_json(tiny_decoder):
    """The control: the same seeds without the mask give no JSON (so the test above tests the mask)."""
    prompt = tiny_decoder.text_prompt("json please")
    for seed in (1, 2, 3):
        tokens, fin = run(tiny_decoder, prompt, params(None, max_tokens=40, temperature=1.0, seed=seed))
        with pytest.raises(ValueError):
            json.loads(text_of(tokens, fin))


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0},
        {"temperature": 1.5, "top_k": 3, "seed": 4},
        {"temperature": 0.8, "top_p": 0.5, "seed": 5},
        {"temperature": 1.0, "min_p": 0.3, "seed": 6},
        {"temperature": 1.0, "repetition_penalty": 1.5, "presence_penalty": 1.0, "seed": 7},
        {"temperature": 1.0, "logit_bias": "ban {", "seed": 8},
    ],
)
def test_constraint_when_any_sampling_setting_then_still_valid(tiny_decoder, sampling):
    """Every sampler setting composes with the mask; even a -100 bias on the only allowed first token
    (`{`) cannot break the JSON."""
    if sampling.get("logit_bias") == "ban {":
        (brace,) = tiny_decoder.tokenizer.encode("{", add_special_tokens=False)
        sampling = {**sampling, "logit_bias": ((brace, -100.0),)}
    prompt = tiny_decoder.text_prompt("json please")
    tokens, fin = run(tiny_decoder, prompt, params(json_schema_grammar(PERSON), **sampling))
    jsonschema.validate(json.loads(text_of(tokens, fin)), PERSON)


def test_constraint_when_logprobs_then_they_are_the_models_own(tiny_decoder):
    """Logprobs report the model's distribution, not the masked one: the same as without a constraint
    for the same forced first token."""
    prompt = tiny_decoder.text_prompt("json please")
    constrained, _ = run(
        tiny_decoder, prompt, params(json_schema_grammar(PERSON), temperature=0.0, logprobs=5)
    )
    first = constrained[0]
    assert first.text == "{"  # the only start an object has (a token of its own in this vocabulary)
    free, _ = run(tiny_decoder, prompt, params(None, max_tokens=1, temperature=0.0, logprobs=5))
    assert [t.token for t in first.top_logprobs] == [t.token for t in free[0].top_logprobs]
    assert "{" not in [t.token for t in free[0].top_logprobs]  # the model did not want it...
    assert first.logprob < free[0].logprob  # ...and its logprob says so


def test_constraint_when_max_tokens_cuts_then_length_and_json_incomplete(tiny_decoder):
    prompt = tiny_decoder.text_prompt("json please")
    tokens, fin = run(
        tiny_decoder, prompt, params(json_schema_grammar(PERSON), max_tokens=4, temperature=0.0)
    )
    assert fin.finish_reason == "length" and len(tokens) == 4
    with pytest.raises(ValueError):
        json.loads(text_of(tokens, fin))


def test_constraint_when_ignore_eos_then_reply_still_ends_with_the_grammar(tiny_decoder):
    prompt = tiny_decoder.text_prompt("json please")
    g = json_schema_grammar({"enum": ["yes", "no"]})
    tokens, fin = run(
        tiny_decoder, prompt, GenerationParams(GREEDY, max_tokens=50, ignore_eos=True, grammar=g)
    )
    assert fin.finish_reason == "stop" and text_of(tokens, fin) in ('"yes"', '"no"')


def test_constraint_when_variant_switches_mid_reply_then_constraint_kept(tiny_decoder):
    """The governor switches q4 -> f32 after a few tokens: the engine re-prefills, the constraint state
    (advanced on emitted tokens only) carries on, and the reply is the same valid JSON."""
    prompt = tiny_decoder.text_prompt("json please")
    g = json_schema_grammar(PERSON)
    plain, _ = run(tiny_decoder, prompt, params(g, temperature=0.0))
    calls = []

    def hook():
        calls.append(1)
        return EngineLimits(variant="f32") if len(calls) == 5 else None

    switched, fin = run(tiny_decoder, prompt, params(g, temperature=0.0), step_hook=hook)
    assert fin.variant == "f32"
    assert [t.token_id for t in switched] == [t.token_id for t in plain]  # both variants are exact here
    jsonschema.validate(json.loads(text_of(switched, fin)), PERSON)


def test_constraint_when_prefetch_on_or_off_then_same_reply(tiny_decoder):
    """The mask computed on the helper thread during the forward pass is the one computed in line."""
    prompt = tiny_decoder.text_prompt("json please")
    replies = []
    for prefetch in (True, False):
        tiny_decoder.mask_prefetch = prefetch
        tokens, _ = run(tiny_decoder, prompt, params(json_schema_grammar(PERSON), temperature=1.0, seed=9))
        replies.append([t.token_id for t in tokens])
    assert replies[0] == replies[1]


# ---- the constraint object ----------------------------------------------------------------------------


def test_mask_when_grammar_not_complete_then_no_end_token_allowed(tiny_decoder):
    vocab = ConstraintVocabulary.for_tokenizer(tiny_decoder.tokenizer)
    c = Constraint(json_schema_grammar({"enum": ["ab"]}), vocab)
    eos = sorted(tiny_decoder.tokenizer.eos_ids)
    for piece in ['"', "a", "b"]:
        assert not c.allowed()[eos].any()
        c.advance(tiny_decoder.tokenizer.encode(piece, add_special_tokens=False)[0])
    assert not c.allowed()[eos].any()  # '"ab' is not yet the string
    c.advance(tiny_decoder.tokenizer.encode('"', add_special_tokens=False)[0])
    allowed = c.allowed()
    assert c.accepting and c.finished
    assert set(np.flatnonzero(allowed)) == set(eos)  # complete: only the end


def test_mask_when_special_token_texts_then_never_allowed_as_text(tiny_decoder):
    """`<|im_end|>` written by a grammar literal is text, never the control token."""
    vocab = ConstraintVocabulary.for_tokenizer(tiny_decoder.tokenizer)
    c = Constraint(gbnf_grammar('root ::= "<|im_start|>" [a-z]+'), vocab)
    special = sorted(tiny_decoder.tokenizer.special_ids)
    assert not c.allowed()[special].any()


def test_rebind_when_other_tokenizer_then_continues_from_the_text_so_far(
    tiny_decoder, tiny_model_dir, tmp_path
):
    """A model switch mid-reply: the constraint is rebuilt over the other tokenizer from the bytes emitted
    so far, and a reply finished on the other side is valid. (The other tokenizer here has a different
    vocabulary: the tiny one without its merges.)"""
    import shutil

    from models.runtime.tokenizer import Tokenizer

    other_dir = tmp_path / "other"
    other_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, other_dir / name)
    doc = json.loads((other_dir / "tokenizer.json").read_text())
    doc["model"]["merges"] = []
    (other_dir / "tokenizer.json").write_text(json.dumps(doc))
    other = Tokenizer.load(other_dir)
    grammar = json_schema_grammar(PERSON)
    first = Constraint(grammar, ConstraintVocabulary.for_tokenizer(tiny_decoder.tokenizer))
    for t in tiny_decoder.tokenizer.encode('{"name": "the", "ag', add_special_tokens=False):
        first.advance(t)
    second = first.rebind(ConstraintVocabulary.for_tokenizer(other))
    rng = np.random.default_rng(0)
    text = bytes(second.emitted)
    while not second.finished:
        token = int(rng.choice(np.flatnonzero(second.allowed())))
        if token in other.eos_ids:
            break
        second.advance(token)
        text = bytes(second.emitted)
    assert text.startswith(b'{"name": "the", "ag')
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("direction", ["to sentencepiece", "from sentencepiece"])
def test_rebind_when_sentencepiece_with_prefix_space_then_bytes_kept_exactly(tiny_decoder, direction):
    """A SentencePiece tokenizer that adds a prefix space when encoding (Llama 2 style): the rebound
    constraint continues from exactly the emitted bytes, an unfinished UTF-8 character included."""
    from models.convert.tokenizer_gguf import tokenizer_from_metadata
    from tests.tiny_vocab import FAMILIES, family_metadata

    spm = tokenizer_from_metadata(family_metadata(FAMILIES["llama2"]))
    assert spm.add_space_prefix
    a, b = (tiny_decoder.tokenizer, spm) if direction == "to sentencepiece" else (spm, tiny_decoder.tokenizer)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    first = Constraint(json_schema_grammar(schema), ConstraintVocabulary.for_tokenizer(a))
    so_far = '{"name": "thé'.encode()[:-1]  # ends inside the two bytes of "é"
    for t in ConstraintVocabulary.for_tokenizer(a).spell(so_far):
        first.advance(t)
    assert bytes(first.emitted) == so_far
    second = first.rebind(ConstraintVocabulary.for_tokenizer(b))
    rng = np.random.default_rng(1)
    while not second.finished:
        token = int(rng.choice(np.flatnonzero(second.allowed())))
        if token in b.eos_ids:
            break
        second.advance(token)
    text = bytes(second.emitted)
    assert text.startswith(so_far)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("schema", "what"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"$ref": "#/definitions/missing"}, "missing"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, ""),
    ],
)
def test_check_when_schema_unsupported_or_invalid_then_invalid_parameter_naming_it(schema, what):
    with pytest.raises(InvalidParameter) as err:
        check_grammar(json_schema_grammar(schema), "response_format")
    assert err.value.param == "response_format" and what in str(err.value)


def test_check_when_gbnf_broken_then_invalid_parameter():
    with pytest.raises(InvalidParameter) as err:
        check_grammar(gbnf_grammar("root ::= ("), "grammar")
    assert err.value.param == "grammar"


# A schema whose only value is a definition that only refers to itself: no JSON text satisfies it.
SELF_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}


def test_check_when_ref_cycle_allows_no_output_then_invalid_parameter():
    """It compiled, and the reply was an empty 200: the first mask is where llguidance finds nothing can
    be written."""
    with pytest.raises(InvalidParameter) as err:
        check_grammar(json_schema_grammar(SELF_REF), "response_format")
    assert err.value.param == "response_format" and "allows no output" in err.value.message


def test_check_when_the_cycle_is_a_few_bytes_in_then_refused_up_front():
    """The same cycle behind a required property: the first mask is fine, and the check's walk of the
    first bytes (`{"a":`) reaches it: a 400 before any reply."""
    schema = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/a"}},
        "required": ["a"],
        "$defs": SELF_REF["$defs"],
    }
    with pytest.raises(InvalidParameter) as err:
        check_grammar(json_schema_grammar(schema), "response_format")
    assert err.value.param == "response_format"


def test_constraint_when_matcher_fails_mid_reply_then_constraint_failed(tiny_decoder):
    """The cycle behind a required property past what the check walks (a 40-character constant first):
    the start is fine, the matcher fails once the reply reaches it. That is an error (a 400, or an error
    event in a stream), not a reply cut short."""
    schema = {
        "type": "object",
        "properties": {"pad": {"const": "x" * 40}, "a": {"$ref": "#/$defs/a"}},
        "required": ["pad", "a"],
        "$defs": SELF_REF["$defs"],
    }
    grammar = json_schema_grammar(schema)
    check_grammar(grammar, "response_format")  # nothing to see in the first bytes
    prompt = tiny_decoder.text_prompt("json please")
    for prefetch in (True, False):
        tiny_decoder.mask_prefetch = prefetch
        with pytest.raises(ConstraintFailed, match="cannot go on"):
            run(tiny_decoder, prompt, params(grammar, temperature=0.0))
