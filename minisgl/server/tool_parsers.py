"""Tool calls in a model's text: one parser per format the models are trained to write.

Models write a call in the form their chat template taught them: Hermes, Qwen 2.5 and Qwen 3
wrap a JSON object in `<tool_call>...</tool_call>`; Llama 3.1-3.3 answer with the bare JSON
object (after `<|python_tag|>`, a special token that detokenizing drops). A parser finds the
calls in a whole answer, and tells a stream how much of its text is surely not the start of
a call, so that text can go out while a call is held back until it is complete.

`PARSERS` is the registry, as `attention/registry.py`'s is for backends: a new format is one
class and one line. `find_calls` tries each in turn, so a server needs no flag naming its
model's format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API sends it


class ToolParser:
    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """The text before the calls and the calls; None if the text holds no call."""
        raise NotImplementedError

    def held(self, text: str) -> int:
        """Where a stream must stop sending: from here on the text may be a call."""
        raise NotImplementedError


def _call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, {})
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        start = text.find(self.OPEN)
        if start < 0:
            return None
        calls = []
        for block in self.BLOCK.findall(text, start):
            try:
                call = _call(json.loads(block))
            except json.JSONDecodeError:
                return None
            if call is None:
                return None
            calls.append(call)
        return text[:start], calls

    def held(self, text: str) -> int:
        if (start := text.find(self.OPEN)) >= 0:
            return start
        # The tail may be the first characters of the tag, cut between two tokens.
        for n in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
            if self.OPEN.startswith(text[-n:]):
                return len(text) - n
        return len(text)


class Llama3JsonParser(ToolParser):
    """The whole answer is `{"name": ..., "parameters": {...}}`, calls apart by `;`."""

    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        rest = text.strip().removeprefix(self.TAG).lstrip()
        if not rest.startswith("{"):
            return None
        decoder, calls = json.JSONDecoder(), []
        while rest:
            try:
                obj, end = decoder.raw_decode(rest)
            except json.JSONDecodeError:
                return None
            key = "parameters" if isinstance(obj, dict) and "parameters" in obj else "arguments"
            if (call := _call(obj, key)) is None:
                return None
            calls.append(call)
            rest = rest[end:].strip().removeprefix(";").strip()
        return "", calls

    def held(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith(("{", self.TAG)) or self.TAG.startswith(head):
            return 0
        return len(text)


PARSERS: dict[str, ToolParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}


def find_calls(text: str) -> tuple[str, list[ToolCall]] | None:
    """The first registered format that finds calls in the text: its content and calls."""
    for parser in PARSERS.values():
        if (found := parser.parse(text)) is not None:
            return found
    return None


def held(text: str) -> int:
    """How much of a streamed text may go out as content now, whatever the format."""
    return min(parser.held(text) for parser in PARSERS.values())
