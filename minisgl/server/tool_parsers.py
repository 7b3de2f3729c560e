"""Tool calls in a model's text: one parser per format the models are trained to write.

Models write a call in the form their chat template taught them: Hermes, Qwen 2.5 and Qwen 3
wrap a JSON object in `<tool_call>...</tool_call>`; Llama 3.1-3.3 answer with the bare JSON
object (after `<|python_tag|>`, a special token that detokenizing drops). A parser scans a
text for the calls in it, whole or as it streams in: where the content before the calls
ends, and the calls so far. As a stream's text grows, what a scan returns only grows with
it, so a stream can send the content, each call's name and its arguments piece by piece.

A call streams once it reads `{"name": "...", "arguments": {` (the form every template
teaches); its arguments are the JSON text that follows, up to the bracket that closes it.
A call in another form (the arguments first, or as a string) is found in the whole text.

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
    done: bool = True  # False: the arguments are not closed yet (or were cut short)


Scan = tuple[int, list[ToolCall]]  # where the content ends, and the calls after it

CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


def json_end(text: str, start: int) -> int | None:
    """The end of the JSON object or array that opens at `start`; None if not closed yet."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def read_call(text: str, pos: int) -> tuple[ToolCall | None, int]:
    """The call whose object opens at `pos` (after blanks), as far as it has come, and where
    its arguments end; None until its name and the start of its arguments are there."""
    head = CALL_HEAD.match(text, pos)
    if head is None:
        return None, pos
    end = json_end(text, head.end())
    args = text[head.end() : end or len(text)]
    return ToolCall(json.loads(head.group(1)), args, end is not None), end or len(text)


NEXT_CALL = re.compile(r"\s*\}\s*,")


def scan_call_array(text: str, final: bool) -> Scan:
    """The answer a grammar held to `[{"name": ..., "arguments": {...}}, ...]`, or to a JSON
    document of the response format instead (it opens with "{": content, all of it)."""
    head = text.lstrip()
    if not head.startswith("["):
        return (len(text) if head or final else 0), []
    calls: list[ToolCall] = []
    pos = len(text) - len(head) + 1
    while True:
        call, end = read_call(text, pos)
        if call is None:
            break
        calls.append(call)
        if not call.done or (after := NEXT_CALL.match(text, end)) is None:
            break
        pos = after.end()
    return 0, calls


def _call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    """A call decoded whole, in any of the forms models write."""
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


def is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except json.JSONDecodeError:
        return False


class ToolParser:
    def scan(self, text: str, final: bool) -> Scan:
        """The content's end and the calls so far; `final`: the text is whole."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """The text before the calls and the calls; None if the text holds no call."""
        end, calls = self.scan(text, final=True)
        if not calls or not all(is_object(c.arguments) for c in calls if c.done):
            return None
        return text[:end], calls


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.OPEN)
        if start < 0:
            return (len(text) if final else self.held(text)), []
        calls: list[ToolCall] = []
        pos = start
        while (block := text.find(self.OPEN, pos)) >= 0:
            block += len(self.OPEN)
            call, pos = read_call(text, block)
            if call is None:  # not a call yet, or in a form only the whole block shows
                if not final:
                    break
                close = text.find(self.CLOSE, block)
                pos = len(text) if close < 0 else close
                try:
                    call = _call(json.loads(text[block:pos]))
                except json.JSONDecodeError:
                    call = None
                if call is None:
                    break
            calls.append(call)
            if not call.done:
                break
        return (len(text) if final and not calls else start), calls

    def held(self, text: str) -> int:
        # The tail may be the first characters of the tag, cut between two tokens.
        for n in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
            if self.OPEN.startswith(text[-n:]):
                return len(text) - n
        return len(text)


class Llama3JsonParser(ToolParser):
    """The whole answer is `{"name": ..., "parameters": {...}}`, calls apart by `;`."""

    TAG = "<|python_tag|>"
    APART = re.compile(r"\s*\}?\s*;?\s*")

    def scan(self, text: str, final: bool) -> Scan:
        head = text.lstrip()
        rest = head.removeprefix(self.TAG).lstrip()
        if not rest.startswith("{"):
            waiting = not final and (not rest or self.TAG.startswith(head))
            return (0 if waiting else len(text)), []
        calls: list[ToolCall] = []
        pos = len(text) - len(rest)
        while pos < len(text):
            call, end = read_call(text, pos)
            if call is None:
                if not final:
                    break
                calls += self.decode(text[pos:]) or []
                break
            calls.append(call)
            if not call.done:
                break
            pos = self.APART.match(text, end).end()  # the object's "}", then ";"
        return (len(text) if final and not calls else 0), calls

    def decode(self, rest: str) -> list[ToolCall] | None:
        """Calls decoded whole, one object after another; None if one is not a call."""
        decoder, calls = json.JSONDecoder(), []
        rest = rest.strip()
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
        return calls


PARSERS: dict[str, ToolParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}


def find_calls(text: str) -> tuple[str, list[ToolCall]] | None:
    """The first registered format that finds calls in the text: its content and calls."""
    for parser in PARSERS.values():
        if (found := parser.parse(text)) is not None:
            return found
    return None


def scan_any(text: str, final: bool) -> tuple[str | None, Scan]:
    """A stream's scan before it knows the format: the first parser that sees a call (the
    stream keeps to it), or none and how much of the text is content in every format."""
    scans = {name: parser.scan(text, final) for name, parser in PARSERS.items()}
    for name, (end, calls) in scans.items():
        if calls:
            return name, (end, calls)
    return None, (min(end for end, _ in scans.values()), [])
