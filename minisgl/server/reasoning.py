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
A whole answer is split by the same code in one piece, so whole and streamed agree. An
answer cut short inside the block is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A block's opening and closing: Qwen's tags, and Gemma 4's thought channel (special tokens,
# kept in the text where the template writes them: tokenizer/tools.py).
STYLES = {"think": ("<think>", "</think>"), "channel": ("<|channel>thought", "<channel|>")}


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

    def stream(self, index: int, text: str, final: bool) -> tuple[str, str]:
        """A choice's next piece of text as (reasoning, content); `final`: the last piece."""
        split = self.splits.setdefault(index, Split("lead" if self.opened else "start"))
        return feed(split, text, final, *STYLES[self.style])

    def whole(self, text: str) -> tuple[str, str]:
        """A whole answer as (reasoning, content)."""
        split = Split("lead" if self.opened else "start")
        return feed(split, text, True, *STYLES[self.style])


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
