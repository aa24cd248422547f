"""llguidance or xgrammar? Measures both on simmer's own tokenizers. Prints JSON.

For each tokenizer built from a GGUF by simmer's converter (SmolLM2: byte-level BPE, 49,152 tokens; Gemma 3:
SentencePiece-derived BPE, 262,144 tokens) and each library importable in this interpreter:
- tokenizer setup (once per model), compile time per schema (a fresh grammar with the tokenizer),
- mask time per token while walking a valid instance token by token (fill the bitmask, then consume),
- RSS growth of the process over setup + compile.

    python -m studies.experiments.constrain_libs --lib llguidance --gguf SmolLM2.gguf --gguf gemma.gguf

xgrammar imports torch at import time (and its wheel requires torch, triton and transformers), so it is not
a simmer dependency: run its column in a scratch venv that has it, with PYTHONPATH pointing at simmer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import psutil

from models.convert.tokenizer_gguf import tokenizer_from_gguf
from models.runtime.tokenizer import Tokenizer

SCHEMAS: dict[str, tuple[dict, str]] = {
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string"},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}',
    ),
    "order": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "status": {"enum": ["pending", "shipped", "delivered"]},
                "customer": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 40},
                        "address": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                            "required": ["city"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["name", "address"],
                    "additionalProperties": False,
                },
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "qty": {"type": "integer", "minimum": 1},
                            "price": {"type": "number", "minimum": 0},
                        },
                        "required": ["sku", "qty", "price"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["id", "status", "customer", "items"],
            "additionalProperties": False,
        },
        '{"id": "ABC-1234", "status": "shipped", "customer": {"name": "Grace Hopper", "address": '
        '{"city": "Arlington", "zip": "22201"}}, "items": [{"sku": "kettle", "qty": 2, "price": 19.5}, '
        '{"sku": "mug", "qty": 6, "price": 4.25}]}',
    ),
    "any_json": (
        {"type": "object"},
        '{"answer": "Paris is the capital of France, and it has been for a very long time.", "n": [1, 2]}',
    ),
}


def rss() -> int:
    return psutil.Process().memory_info().rss


def token_bytes(tok: Tokenizer) -> list[bytes]:
    return [tok.token_bytes(i) for i in range(tok.vocab_size)]


class Llguidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer) -> None:
        from models.runtime.constraint import ConstraintVocabulary

        self.vocab = ConstraintVocabulary.for_tokenizer(tok)
        self.n = tok.vocab_size

    def compile(self, schema: dict):
        import llguidance as llg

        from models.runtime.constraint import json_schema_grammar

        return llg.LLMatcher(self.vocab.llg, json_schema_grammar(schema))

    def steps(self, matcher, ids: list[int]) -> list[float]:
        import llguidance.numpy as lln

        bitmask = lln.allocate_token_bitmask(1, self.n)
        times = []
        for i in ids:
            t0 = time.perf_counter()
            lln.fill_next_token_bitmask(matcher, bitmask)
            times.append(time.perf_counter() - t0)
            assert matcher.consume_token(i), matcher.get_error()
        return times


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer) -> None:
        import xgrammar as xgr

        vocab = [b"" if i in tok.special_ids else b for i, b in enumerate(token_bytes(tok))]
        info = xgr.TokenizerInfo(
            vocab, vocab_type=xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=sorted(tok.eos_ids)
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.n = tok.vocab_size

    def compile(self, schema: dict):
        import xgrammar as xgr

        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
        return xgr.GrammarMatcher(compiled)

    def steps(self, matcher, ids: list[int]) -> list[float]:
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.n)
        times = []
        for i in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t0)
            assert matcher.accept_token(i)
        return times


LIBS = {"llguidance": Llguidance, "xgrammar": Xgrammar}


def measure(lib: str, gguf: Path, repeats: int) -> dict:
    tok = tokenizer_from_gguf(gguf)
    base = rss()
    t0 = time.perf_counter()
    impl = LIBS[lib](tok)
    setup_s = time.perf_counter() - t0
    out: dict = {
        "tokenizer": gguf.name,
        "kind": tok.kind,
        "vocab": tok.vocab_size,
        "setup_s": round(setup_s, 3),
        "schemas": {},
    }
    for name, (schema, instance) in SCHEMAS.items():
        ids = tok.encode(instance, add_special_tokens=False)
        compile_s, per_token = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            matcher = impl.compile(schema)
            compile_s.append(time.perf_counter() - t0)
            per_token += impl.steps(matcher, ids)
        out["schemas"][name] = {
            "tokens": len(ids),
            "compile_ms_median": round(statistics.median(compile_s) * 1000, 3),
            "mask_us_mean": round(statistics.fmean(per_token) * 1e6, 1),
            "mask_us_p50": round(statistics.median(per_token) * 1e6, 1),
            "mask_us_max": round(max(per_token) * 1e6, 1),
        }
    out["rss_growth_mb"] = round((rss() - base) / 2**20, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", choices=sorted(LIBS), required=True)
    ap.add_argument("--gguf", type=Path, action="append", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    results = [measure(args.lib, g, args.repeats) for g in args.gguf]
    json.dump({"lib": args.lib, "results": results}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
