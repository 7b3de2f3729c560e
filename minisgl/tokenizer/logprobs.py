"""The tokenizer worker's part of chapter 25: logprobs as the API shows them, and echo.

The scheduler reports token ids; the API names each token by its text and by its bytes,
and lists the likeliest alternatives the same way. The bytes are the token's own: with
byte-level BPE a token may hold part of a UTF-8 character, which decoding the token alone
turns into U+FFFD, so they are read from the token's spelling in the vocabulary. Echo
sends the prompt's text back with a request's first delta.
"""

from __future__ import annotations

from tokenizers import decoders

from minisgl.message.backend import TokenMsg
from minisgl.message.frontend import DeltaMsg, TokenizeMsg
from minisgl.message.logprobs import TokenLogprob
from minisgl.tokenizer.tokenizer import Tokenizer


class LogprobTexts:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.rust.decoder, decoders.ByteLevel)
        self.echoes: dict[int, str] = {}  # prompt texts for the first delta

    def accept(self, msg: TokenizeMsg, ids: list[int]) -> None:
        if msg.echo:
            self.echoes[msg.uid] = msg.prompt or self.tokenizer.decode(ids, False)

    def forget(self, uid: int) -> None:
        self.echoes.pop(uid, None)

    def add(self, delta: DeltaMsg, msg: TokenMsg) -> None:
        """Token ids to text and bytes, for the logprobs the request asked for; and echo."""
        delta.prompt_text = self.echoes.pop(msg.uid, None)
        if msg.logprob is not None:
            delta.token_bytes = list(self.token_bytes(msg.token))
        if msg.top_ids is not None and msg.top_logprobs is not None:
            delta.top_logprobs = self.token_logprobs(msg.top_ids, msg.top_logprobs)
        if (prompt := msg.prompt_logprobs) is not None:
            first, *rest = prompt.token_ids
            tops = [self.token_logprobs(i, v) for i, v in zip(prompt.top_ids, prompt.top_logprobs)]
            delta.prompt_logprobs = [self.token_logprob(first, None)] + [
                self.token_logprob(t, v, top) for t, v, top in zip(rest, prompt.logprobs, tops)
            ]

    def token_logprobs(self, ids: list[int], values: list[float]) -> list[TokenLogprob]:
        return [self.token_logprob(t, v) for t, v in zip(ids, values)]

    def token_logprob(
        self, token: int, value: float | None, top: list[TokenLogprob] | None = None
    ) -> TokenLogprob:
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        return TokenLogprob(text, value, list(self.token_bytes(token)), top or [])

    def token_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.rust.id_to_token(token_id) if self.byte_level else None
        if piece is not None and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()


def _byte_level_alphabet() -> dict[str, int]:
    # Byte-level BPE spells every byte as a printable character: the printable Latin-1
    # bytes stand for themselves, the other 68 are moved, in order, to U+0100 and up.
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(0x100 + i): b for i, b in enumerate(moved)}


_BYTE_OF_CHAR = _byte_level_alphabet()
