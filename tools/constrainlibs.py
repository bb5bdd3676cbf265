"""Which constrained-decoding library: compile and mask times on the embedded tokenizer.

``python -m tools.constrainlibs [--json FILE] [--repeat N]`` loads the embedded model's
tokenizer (SmolLM2, 49,152 tokens, byte-level BPE) and, for each of llguidance,
xgrammar and outlines-core that imports, measures side by side in one run:

* ``compile_ms``: from a JSON schema (``SCHEMA``, a typical tool-call shape) to a
  matcher ready for its first mask, the tokenizer's one-time setup timed apart
  (``tokenizer_ms``);
* ``mask_us``: the mean time to compute the next-token mask, over the tokens of a
  document that conforms (``DOCUMENT``), advancing the matcher with each.

Medians over ``--repeat`` runs. The choice and its reasons are in
``docs/structured-output.md``. A library not installed is reported as such.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "unit"],
    "additionalProperties": False,
}
DOCUMENT = ('{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", '
            '"tags": ["math", "engines"], "unit": "celsius", "address": {"city": "London"}}')


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1000, out


def llguidance_run(tokenizer: Any, ids: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    setup_ms, lltok = _timed(lambda: llguidance.hf.from_tokenizer(tokenizer))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    compile_ms, matcher = _timed(lambda: llguidance.LLMatcher(lltok, grammar))
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    first_ms, _ = _timed(lambda: llguidance.torch.fill_next_token_bitmask(matcher, mask, 0))
    matcher.consume_token(ids[0])
    spent = 0.0
    for token in ids[1:]:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        spent += time.perf_counter() - start
        assert matcher.consume_token(token), matcher.get_error()
    again = llguidance.LLMatcher(lltok, grammar)  # the grammar's lexer states now built
    warm = 0.0
    for token in ids:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(again, mask, 0)
        warm += time.perf_counter() - start
        again.consume_token(token)
    return {"tokenizer_ms": setup_ms, "compile_ms": compile_ms + first_ms,
            "mask_us": spent / (len(ids) - 1) * 1e6, "mask_us_second": warm / len(ids) * 1e6}


def xgrammar_run(tokenizer: Any, ids: list[int]) -> dict[str, float]:
    import xgrammar

    setup_ms, compiler = _timed(lambda: xgrammar.GrammarCompiler(
        xgrammar.TokenizerInfo.from_huggingface(tokenizer), cache_enabled=False))
    compile_ms, compiled = _timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    spent = 0.0
    for token in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        spent += time.perf_counter() - start
        assert matcher.accept_token(token)
    again = xgrammar.GrammarMatcher(compiled)
    warm = 0.0
    for token in ids:
        start = time.perf_counter()
        again.fill_next_token_bitmask(mask, 0)
        warm += time.perf_counter() - start
        again.accept_token(token)
    return {"tokenizer_ms": setup_ms, "compile_ms": compile_ms, "mask_us": spent / len(ids) * 1e6,
            "mask_us_second": warm / len(ids) * 1e6}


def outlines_core_run(tokenizer: Any, ids: list[int]) -> dict[str, float]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import (
        build_regex_from_schema,
    )

    def vocabulary() -> Any:
        byte_of = _byte_level_alphabet()
        tokens: dict[bytes, list[int]] = {}
        eos = tokenizer.eos_token_id
        for text, token in tokenizer.get_vocab().items():
            if token != eos and token not in tokenizer.all_special_ids:
                raw = bytes(byte_of[c] for c in text if c in byte_of)
                tokens.setdefault(raw, []).append(token)
        return Vocabulary(eos, tokens)

    setup_ms, vocab = _timed(vocabulary)
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    compile_ms, index = _timed(lambda: Index(regex, vocab))
    guide = Guide(index)
    spent = 0.0
    for token in ids:
        start = time.perf_counter()
        guide.get_tokens()
        spent += time.perf_counter() - start
        guide.advance(token)
    return {"tokenizer_ms": setup_ms, "compile_ms": compile_ms, "mask_us": spent / len(ids) * 1e6,
            "mask_us_second": spent / len(ids) * 1e6}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each printable stand-in character's byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(kept), 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(kept, chars, strict=True)}


RUNS = {"llguidance": llguidance_run, "xgrammar": xgrammar_run,
        "outlines-core": outlines_core_run}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here (default: stdout)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    from engine.model import load_model

    tokenizer = load_model("smollm2").tokenizer
    ids = tokenizer.encode(DOCUMENT)
    results: dict[str, Any] = {"vocab": len(tokenizer), "document_tokens": len(ids),
                               "repeat": args.repeat}
    for name, run in RUNS.items():
        try:
            rows = [run(tokenizer, ids) for _ in range(args.repeat)]
        except ImportError as exc:
            results[name] = {"error": f"not installed: {exc}"}
            continue
        results[name] = {key: round(statistics.median(r[key] for r in rows), 2)
                         for key in rows[0]}
    text = json.dumps(results, indent=2)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
