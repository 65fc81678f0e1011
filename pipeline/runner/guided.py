"""Structured output: constraints compiled by xgrammar, applied as a token bitmask before sampling.

xgrammar compiles a grammar once into a pushdown automaton whose per-state token masks are mostly
precomputed, so filling the mask of a step is a few microseconds per row; llguidance, the other
library that installs here, computes masks lazily (about 13x slower per token on SmolLM2's
vocabulary in our side-by-side). Each distinct constraint is compiled once and cached by its
digest; each running request has its own matcher. A step's masks are filled on a worker thread
while the forward pass runs (the matchers already hold every token accepted up to the previous
step), then applied to the logits of the constrained rows before sampling.
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..engine.request import ResponseFormat


class GrammarError(ValueError):
    """A constraint that cannot be compiled (an invalid schema, regex or grammar)."""


def _choice_ebnf(choices: tuple[str, ...]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarBook:
    """Compiled constraints for one tokenizer and vocabulary, cached by digest. Safe to share
    between the preparation thread (which compiles to validate) and the engine."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...] = ()) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._compiled: dict[str, object] = {}
        self._lock = threading.Lock()

    def compile(self, fmt: ResponseFormat):
        key = fmt.key
        with self._lock:
            hit = self._compiled.get(key)
        if hit is not None:
            return hit
        try:
            # JSON without free whitespace (", " and ": " separators): a small model left free
            # whitespace can spend its whole max_tokens on it, and the text is shorter.
            if fmt.type == "json_schema":
                compiled = self.compiler.compile_json_schema(json.dumps(fmt.json_schema), any_whitespace=False,
                                                             strict_mode=True)
            elif fmt.type == "json_object":
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                             strict_mode=False)
            elif fmt.type == "regex":
                compiled = self.compiler.compile_regex(fmt.pattern)
            elif fmt.type == "choice":
                compiled = self.compiler.compile_grammar(_choice_ebnf(fmt.choices))
            else:
                compiled = self.compiler.compile_grammar(fmt.ebnf)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own kinds
            what = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choices",
                    "json_object": "JSON grammar"}[fmt.type]
            raise GrammarError(f"invalid {what} ({str(e).splitlines()[0][:300]})") from None
        with self._lock:
            self._compiled[key] = compiled
        return compiled

    def error(self, fmt: ResponseFormat) -> str | None:
        """Why fmt does not compile, or None (compiling it into the cache)."""
        try:
            self.compile(fmt)
        except GrammarError as e:
            return str(e)
        return None

    def matcher(self, fmt: ResponseFormat):
        return self.xgr.GrammarMatcher(self.compile(fmt))


class Constraints:
    """The runner's side: a matcher per constrained request, masks filled off the critical path."""

    def __init__(self, book: GrammarBook) -> None:
        self.book = book
        self.matchers: dict[str, object] = {}
        # Tokens each matcher has accepted.
        self.accepted: dict[str, int] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgen-mask")
        self.batch = book.xgr.BatchGrammarMatcher(max_threads=1)

    def _matcher(self, seq):
        """The request's matcher, holding exactly its output tokens so far. A fork that fell back
        to running on its own (no block for it) drew a first token it did not keep: its matcher
        starts over."""
        rid = seq.request_id
        m = self.matchers.get(rid)
        if m is None:
            m = self.matchers[rid] = self.book.matcher(seq.sampling.response_format)
            self.accepted[rid] = 0
        elif self.accepted[rid] != seq.output_index:
            assert seq.output_index == 0, f"{rid}: matcher at {self.accepted[rid]} tokens, output at {seq.output_index}"
            m.reset()
            self.accepted[rid] = 0
        return m

    def fill_async(self, seqs) -> tuple[Future, torch.Tensor, list[int]] | None:
        """Start filling the bitmask [len(seqs), words] of this step's sampled rows (unconstrained
        rows allow everything). None when no row is constrained."""
        rows = [i for i, s in enumerate(seqs) if s.sampling.response_format is not None]
        if not rows:
            return None
        matchers = [self._matcher(seqs[i]) for i in rows]
        bitmask = self.book.xgr.allocate_token_bitmask(len(seqs), self.book.vocab_size)
        if len(rows) == 1:
            future = self.pool.submit(matchers[0].fill_next_token_bitmask, bitmask, rows[0])
        else:
            future = self.pool.submit(self.batch.batch_fill_next_token_bitmask, matchers, bitmask, rows)
        return future, bitmask, rows

    def apply(self, pending, logits: torch.Tensor, offset: int = 0) -> None:
        """Mask the rows [offset, offset + len(logits)) of the step in place (-inf where disallowed)."""
        future, bitmask, rows = pending
        future.result()
        local = [r - offset for r in rows if offset <= r < offset + logits.shape[0]]
        if local:
            self.book.xgr.apply_token_bitmask_inplace(logits, bitmask[offset : offset + logits.shape[0]],
                                                      indices=local, vocab_size=self.book.vocab_size)

    def accept(self, seq, token_id: int) -> tuple[bool, bool]:
        """Feed a sampled token to the request's matcher: (accepted, terminated)."""
        m = self.matchers.get(seq.request_id)
        if m is None:
            return True, False
        ok = m.accept_token(token_id)
        self.accepted[seq.request_id] += ok
        return ok, m.is_terminated()

    def forget(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self.accepted.pop(request_id, None)
