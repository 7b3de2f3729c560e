"""Structured output: per request, a grammar that decides which tokens may come next.

A request with a JSON schema gets a matcher: xgrammar's pushdown automaton, compiled from
the schema against our vocabulary. Before each of the request's tokens is sampled, the
matcher writes a bitmask of the tokens that keep the output a prefix of some document the
schema accepts; the engine applies it to the logits on the device (engine/bias.py). Once
the token is sampled the matcher accepts it and moves on; when the document is complete,
only the end-of-sequence tokens are left, and accepting one ends the matcher.

The mask for a step needs the token of the step before. With overlap scheduling the host
sees that token only after it has launched the next step, so a batch with a grammar in it
runs in two halves: the model's forward is launched first, the host then processes the
previous step (its tokens go into the matchers) and fills this step's masks while the
device computes, and only then is the step sampled. Filling and accepting happen on the
host; the device sees one small bit tensor per step. Compiling, which can take from a
millisecond to minutes, happens in worker processes, off the step loop (grammar_pool.py).

xgrammar, with the transformers it imports, takes seconds to load, so it is loaded when
the first request with a schema arrives, not at start-up.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from minisgl.core import Req, SamplingParams
from minisgl.engine.bias import TokenMask
from minisgl.utils import cdiv

if TYPE_CHECKING:
    import xgrammar

    from minisgl.engine.engine import Engine
    from minisgl.scheduler.scheduler import InFlight

logger = logging.getLogger(__name__)


class Grammars:
    """The compiler (made on first use) and the live matchers, by request id."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.model_path, self.vocab_size = Path(model_path), vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self.matchers: dict[int, xgrammar.GrammarMatcher] = {}

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError if the request's logit bias cannot be used (its JSON schema is
        compiled apart, off the step loop: grammar_pool.py)."""
        if not all(0 <= t < self.vocab_size for t in params.logit_bias):
            raise ValueError(
                f"logit_bias has token ids outside the vocabulary [0, {self.vocab_size})"
            )

    def compile(self, json_schema: str) -> xgrammar.CompiledGrammar:
        """The schema's grammar; ValueError if it cannot be used. It may take minutes: the
        scheduler has it done by a worker process (grammar_pool.py)."""
        compiler = self._compiler or self._load()
        try:
            # Whitespace fixed to JSON's usual: a small model left free to choose it may
            # spend all its tokens on blank lines.
            return compiler.compile_json_schema(json_schema, any_whitespace=False)
        except RuntimeError as e:  # xgrammar's message: "[time] file:line: what is wrong"
            reason = str(e).strip().splitlines()[0].split(": ", 1)[-1]
            raise ValueError(f"the JSON schema cannot be used: {reason}") from None

    def add(self, uid: int, grammar: xgrammar.CompiledGrammar) -> None:
        """A matcher for the request, which has a JSON schema, once its grammar is compiled."""
        import xgrammar

        self.matchers[uid] = xgrammar.GrammarMatcher(grammar)

    def remove(self, uid: int) -> None:
        self.matchers.pop(uid, None)

    def constrains(self, reqs: list[Req]) -> bool:
        return bool(self.matchers) and any(r.uid in self.matchers for r in reqs)

    def accept(self, uid: int, token: int) -> bool:
        """Move the request's matcher past `token`; True if the document is now complete."""
        matcher = self.matchers.get(uid)
        if matcher is None:
            return False
        if not matcher.accept_token(token):  # only if the mask was not applied: end it here
            logger.warning("request %d: token %d breaks its grammar; stopping it", uid, token)
            return True
        return matcher.is_terminated()

    def mask(self, reqs: list[Req], emits: list[bool], device: torch.device) -> TokenMask | None:
        """The allowed tokens of each row whose token is real (not a chunk's) and constrained."""
        rows = [i for i, req in enumerate(reqs) if emits[i] and req.uid in self.matchers]
        if not rows:
            return None
        bits = torch.empty(len(rows), cdiv(self.vocab_size, 32), dtype=torch.int32)
        for j, i in enumerate(rows):
            matcher = self.matchers[reqs[i].uid]
            if matcher.is_terminated():  # finished at the step before; its token is dropped
                bits[j] = -1
            else:
                matcher.fill_next_token_bitmask(bits, j)
        return TokenMask.from_host(rows, bits, device)

    def sample(self, flight: InFlight, engine: Engine) -> None:
        """Sample a step whose forward was launched alone, masked (once the step before has
        been processed: the matchers have then seen its tokens)."""
        assert flight.logits is not None
        flight.logits.token_mask = self.mask(flight.batch.reqs, flight.emits, engine.device)
        flight.output, flight.logits = engine.sample_logits(flight.logits), None

    def _load(self) -> xgrammar.GrammarCompiler:
        start = time.perf_counter()
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(self.model_path / "tokenizer.json"))
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
        )
        # Not cached here: the scheduler keeps what it compiled, and knows when to forget it.
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        logger.info("grammar compiler ready in %.1fs", time.perf_counter() - start)
        return self._compiler
