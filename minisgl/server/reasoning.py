"""A thinking model's reasoning apart from its answer: `reasoning_content` beside `content`.

Qwen3, Qwen3.5 and the other thinking models of their kind write their reasoning between
`<think>` and `</think>`, then the answer; Gemma 4 between `<|channel>thought` and
`<channel|>`. Some chat templates open the block in the prompt
(Qwen3.5's, unless `enable_thinking` is false), so the answer starts inside it and only the
closing tag comes; others leave the opening to the model. The tokenizer worker says which
for each request (`AcceptedMsg.thinking`: "open", "may", or None for a template that knows
no such block, whose answers stay as they are).

A chat answer's text is then split as it streams: the reasoning until `</think>` (a tag cut
between two pieces waits for the next), then the content; the blank lines that open each
are dropped.
A whole answer is split by the same code, its pieces fed one at a time, so whole and
streamed agree. An answer cut short inside the block is all reasoning. Each piece is one
token, so the reasoning's tokens are counted as it goes: those up to the last piece inside
the block (the closing tag's included), OpenAI's `reasoning_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A block's opening and closing: Qwen's tags, and Gemma 4's thought channel (special tokens,
# kept in the text where the template writes them: tokenizer/tools.py).
STYLES = {"think": ("<think>", "</think>"), "channel": ("<|channel>thought", "<channel|>")}
INSIDE = ("lead", "think")  # the parts of a split inside the block


@dataclass
class Split:
    """One choice's text, as far as it has come: which part it is in, and what it holds back
    (what may be the start of a tag)."""

    part: str  # "start" (the block may open), "lead" (blanks opening it), "think", "gap"
    # (blanks after it), "content"
    held: str = ""


@dataclass
class Reasoning:
    """One request's answers, split into reasoning and content; `opened`: its prompt opened
    the block."""

    opened: bool
    style: str = "think"  # of STYLES
    splits: dict[int, Split] = field(default_factory=dict)  # by choice index
    tokens: dict[int, int] = field(default_factory=dict)  # by choice: its reasoning's tokens

    def stream(self, index: int, text: str, final: bool, tokens: int = 0) -> tuple[str, str]:
        """A choice's next piece of text as (reasoning, content); `final`: the last piece;
        `tokens`: the choice's tokens so far."""
        split = self.splits.setdefault(index, Split("lead" if self.opened else "start"))
        return self._feed(split, index, text, final, tokens)

    def whole(self, pieces: str | list[str], index: int = 0, tokens: int = 0) -> tuple[str, str]:
        """A whole answer as (reasoning, content), from its text or its pieces (a token
        each, `tokens` of them: the last may have none)."""
        pieces = [pieces] if isinstance(pieces, str) else pieces or [""]
        split, thought, content = Split("lead" if self.opened else "start"), "", ""
        for i, piece in enumerate(pieces):
            final = i == len(pieces) - 1
            r, c = self._feed(split, index, piece, final, min(i + 1, tokens))
            thought, content = thought + r, content + c
        return thought, content

    def _feed(
        self, split: Split, index: int, text: str, final: bool, tokens: int
    ) -> tuple[str, str]:
        inside = split.part in INSIDE
        out = feed(split, text, final, *STYLES[self.style])
        if inside or split.part in INSIDE:
            self.tokens[index] = tokens
        return out


def feed(split: Split, text: str, final: bool, OPEN: str, CLOSE: str) -> tuple[str, str]:  # noqa: N803
    buf, reasoning, content = split.held + text, "", ""
    while True:
        if split.part == "start":
            rest = buf.lstrip()
            if rest.startswith(OPEN):
                buf, split.part = rest[len(OPEN) :], "lead"
            elif OPEN.startswith(rest) and not final:  # nothing yet, or the tag's first part
                break
            else:
                split.part = "content"
        elif split.part == "think":
            end = buf.find(CLOSE)
            if end >= 0:
                reasoning += buf[:end]
                buf, split.part = buf[end + len(CLOSE) :], "gap"
                continue
            keep = 0 if final else partial_tail(buf, CLOSE)
            reasoning += buf[: len(buf) - keep]
            buf = buf[len(buf) - keep :]
            break
        elif split.part in ("lead", "gap"):  # blanks dropped, up to the first other
            rest = buf.lstrip()
            if not rest:
                buf = ""
                break
            buf, split.part = rest, "think" if split.part == "lead" else "content"
        else:
            content, buf = buf, ""
            break
    split.held = buf
    return reasoning, content


def partial_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
