"""Incremental detokenization: turn one token at a time into text that is safe to send.

Decoding each token alone is wrong twice over: byte-level tokens may hold half of a UTF-8
character, and some tokenizers change a token's text depending on its left neighbour
(leading spaces). So we decode a short window of recent tokens twice - without and with
the new ones - and emit the difference, but only once it no longer ends in the
replacement character that marks an unfinished UTF-8 sequence.

Stop strings are matched on the text. Text that could still turn out to be the start of a
stop string is held back until it cannot.
"""

from __future__ import annotations

from minisgl.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Start with a few prompt tokens as left context, so the first output token gets the
        # same leading space it would have inside the full text.
        self.ids = prompt_ids[-4:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = [s for s in stop if s]
        self.text = ""  # everything decoded so far
        self.sent = 0  # how much of `text` has been handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token: int) -> str:
        """Add a generated token; returns the text that may be sent now."""
        if self.stopped:
            return ""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The request is over: the rest of the text, held-back parts included."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        # Several stop strings may complete at once: the earliest one in the text wins.
        found = [at for s in self.stop if (at := self.text.find(s, self.sent)) != -1]
        if found:
            self.text, self.stopped, final = self.text[: min(found)], True, True
        end = len(self.text) if final else len(self.text) - self._held_back()
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if s.startswith(self.text[-n:]):
                    longest = n
                    break
        return longest
