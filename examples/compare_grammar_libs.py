"""xgrammar against llguidance on this machine: compile time and per-token mask cost.

    pip install "batchgen[bench]"   # llguidance
    .venv/bin/python examples/compare_grammar_libs.py [--schema examples/formats/answer.json]

Both libraries install here; batchgen uses xgrammar (batchgen.runner.guided). For SmolLM2's
vocabulary (49,152 tokens), it compiles the JSON schema of the response_format file, then walks
a valid JSON text token by token, filling the next-token bitmask before each token (what the
engine does every step for every constrained row). Medians of --reps walks.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schema", default="examples/formats/answer.json")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from batchgen.models.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("default"))
    vocab = 49152
    schema = json.loads(open(args.schema).read())["schema"]
    text = json.dumps({"topic": "weather", "sentiment": "neutral", "confidence": 70,
                       "answer": "It is likely to rain tomorrow afternoon, so take an umbrella."})
    ids = tok(text, add_special_tokens=False).input_ids

    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema))  # both libraries with flexible whitespace
    xgr_compile = time.perf_counter() - t
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    walks = []
    for _ in range(args.reps):
        m = xgr.GrammarMatcher(compiled)
        t = time.perf_counter()
        for i in ids:
            m.fill_next_token_bitmask(bitmask, 0)
            assert m.accept_token(i)
        walks.append((time.perf_counter() - t) / len(ids))

    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt

    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    t = time.perf_counter()
    llguidance.LLMatcher(ltok, grammar)
    llg_compile = time.perf_counter() - t
    lmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    lwalks = []
    for _ in range(args.reps):
        m = llguidance.LLMatcher(ltok, grammar)
        t = time.perf_counter()
        for i in ids:
            lgt.fill_next_token_bitmask(m, lmask, 0)
            assert m.consume_token(i), m.get_error()
        lwalks.append((time.perf_counter() - t) / len(ids))
    print(json.dumps({"tokens": len(ids),
                      "xgrammar": {"compile_ms": round(xgr_compile * 1e3, 2),
                                   "mask_us_per_token": round(statistics.median(walks) * 1e6, 1)},
                      "llguidance": {"matcher_ms": round(llg_compile * 1e3, 2),
                                     "mask_us_per_token": round(statistics.median(lwalks) * 1e6, 1)}}, indent=1))


if __name__ == "__main__":
    main()
