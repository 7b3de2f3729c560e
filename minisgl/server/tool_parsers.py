"""Tool calls in a model's text: one parser per format the models are trained to write.

Models write a call in the form their chat template taught them: Hermes, Qwen 2.5 and Qwen 3
wrap a JSON object in `<tool_call>...</tool_call>`; Qwen3.5 and Qwen3-Coder write the same
block with `<function=NAME>` and one `<parameter=KEY>` per argument inside, values as text;
Gemma 4 writes `<|tool_call>call:NAME{key:value}<tool_call|>` with its own quote marks;
Llama 3.1-3.3 answer with the bare JSON object (after `<|python_tag|>`, a special token
that detokenizing drops). A parser scans a
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


Schemas = dict[str, dict[str, Any]]  # a request's functions' parameter schemas, by name


class ToolParser:
    OPEN = ""  # the tag a call opens with, in a form that has one

    def held(self, text: str) -> int:
        """Where the content may end: before a tail that may be the first characters of the
        tag, cut between two tokens."""
        for n in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
            if self.OPEN.startswith(text[-n:]):
                return len(text) - n
        return len(text)

    def scan(self, text: str, final: bool, schemas: Schemas | None = None) -> Scan:
        """The content's end and the calls so far; `final`: the text is whole. `schemas`:
        for a form whose arguments are text, the types to read them as."""
        raise NotImplementedError

    def parse(self, text: str, schemas: Schemas | None = None) -> tuple[str, list[ToolCall]] | None:
        """The text before the calls and the calls; None if the text holds no call."""
        end, calls = self.scan(text, final=True, schemas=schemas)
        if not calls or not all(is_object(c.arguments) for c in calls if c.done):
            return None
        return text[:end], calls


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool, schemas: Schemas | None = None) -> Scan:
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


class Llama3JsonParser(ToolParser):
    """The whole answer is `{"name": ..., "parameters": {...}}`, calls apart by `;`."""

    TAG = "<|python_tag|>"
    APART = re.compile(r"\s*\}?\s*;?\s*")

    def scan(self, text: str, final: bool, schemas: Schemas | None = None) -> Scan:
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


class XmlCallParser(HermesParser):
    """Qwen3.5's and Qwen3-Coder's form: in a `<tool_call>` block, `<function=NAME>`, then
    each argument as `<parameter=KEY>`, its value as plain text, `</parameter>`, and
    `</function>`. The values carry no types, so each is read as its parameter's schema
    says (a number, a boolean, an object or array as JSON) and is a string otherwise, as a
    parameter the schema does not know is. The arguments' JSON text grows a parameter at a
    time, as each closes: what a stream has sent never changes."""

    FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
    PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
    END = re.compile(r"\s*</function>(\s*</tool_call>)?")

    def scan(self, text: str, final: bool, schemas: Schemas | None = None) -> Scan:
        start = text.find(self.OPEN)
        if start < 0:
            return (len(text) if final else self.held(text)), []
        calls: list[ToolCall] = []
        pos = start
        while (block := text.find(self.OPEN, pos)) >= 0:
            head = self.FUNCTION.match(text, block + len(self.OPEN))
            if head is None:  # not a call in this form (or not yet)
                break
            name = head.group(1).strip()
            params = ((schemas or {}).get(name) or {}).get("properties") or {}
            call, pos = self.read_arguments(text, head.end(), name, params, final)
            calls.append(call)
            if not call.done:
                break
        return (len(text) if final and not calls else start), calls

    def read_arguments(
        self, text: str, pos: int, name: str, params: dict[str, Any], final: bool
    ) -> tuple[ToolCall, int]:
        """The call's arguments from `pos` on, as far as they have come, and where they end
        (a whole text that stops after a closed parameter closes the call there)."""
        fields = []
        while (head := self.PARAMETER.match(text, pos)) is not None:
            close = text.find("</parameter>", head.end())
            if close < 0:  # the value is still being written
                return ToolCall(name, "{" + ", ".join(fields), False), len(text)
            key = head.group(1).strip()
            value = text[head.end() : close].removeprefix("\n").removesuffix("\n")
            fields.append(f"{json.dumps(key, ensure_ascii=False)}: {typed(value, params.get(key))}")
            pos = close + len("</parameter>")
        end = self.END.match(text, pos)
        if end is None and not (final and not text[pos:].strip()):
            return ToolCall(name, "{" + ", ".join(fields), False), len(text)
        return ToolCall(name, "{" + ", ".join(fields) + "}"), end.end() if end else len(text)


class GemmaCallParser(ToolParser):
    """Gemma 4's form: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, calls one after
    another. Keys are bare, strings sit between `<|"|>` marks (special tokens, kept in the
    text for it: tokenizer/tools.py), numbers, booleans, objects `{...}` and arrays `[...]`
    are written as they are. A call goes out once its name is read, its arguments as JSON
    when its braces close."""

    OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
    HEAD = re.compile(r"\s*call:([A-Za-z0-9_.\-]+)\s*(?=\{)")

    def scan(self, text: str, final: bool, schemas: Schemas | None = None) -> Scan:
        start = text.find(self.OPEN)
        if start < 0:
            return (len(text) if final else self.held(text)), []
        calls: list[ToolCall] = []
        pos = start
        while text.startswith(self.OPEN, pos):
            head = self.HEAD.match(text, pos + len(self.OPEN))
            if head is None:
                break
            try:
                args, pos = self.value(text, head.end())
            except IndexError:  # the arguments are still being written
                calls.append(ToolCall(head.group(1), "", False))
                break
            except ValueError:  # not in this form after all
                break
            if not isinstance(args, dict):
                break
            calls.append(ToolCall(head.group(1), json.dumps(args, ensure_ascii=False)))
            pos = skip_blanks(text, pos)
            if text.startswith(self.CLOSE, pos):
                pos = skip_blanks(text, pos + len(self.CLOSE))
        return (len(text) if final and not calls else start), calls

    def value(self, text: str, pos: int) -> tuple[Any, int]:
        """The value that starts at `pos` (after blanks), and where it ends; IndexError where
        the text ends first, ValueError where it is not in this form."""
        pos = skip_blanks(text, pos)
        if pos >= len(text):
            raise IndexError(pos)
        if text.startswith(self.QUOTE, pos):
            end = text.find(self.QUOTE, pos + len(self.QUOTE))
            if end < 0:
                raise IndexError(pos)
            return text[pos + len(self.QUOTE) : end], end + len(self.QUOTE)
        if text[pos] in "{[":
            closing, items, pos = "}" if text[pos] == "{" else "]", [], pos + 1
            while True:
                pos = skip_blanks(text, pos)
                if pos >= len(text):
                    raise IndexError(pos)
                if text[pos] == closing:
                    break
                if closing == "}":  # a bare key (or one between quote marks), then a colon
                    colon = text.find(":", pos)
                    if colon < 0:
                        raise IndexError(pos)
                    key = text[pos:colon].strip().removeprefix(self.QUOTE).removesuffix(self.QUOTE)
                    item, pos = self.value(text, colon + 1)
                    items.append((key, item))
                else:
                    item, pos = self.value(text, pos)
                    items.append(item)
                pos = skip_blanks(text, pos)
                if pos >= len(text):
                    raise IndexError(pos)
                if text[pos] == ",":
                    pos += 1
                elif text[pos] != closing:
                    raise ValueError(f"{text[pos]!r} after an item")
            return (dict(items) if closing == "}" else items), pos + 1
        if self.QUOTE.startswith(text[pos:]):  # a quote mark, cut between two tokens
            raise IndexError(pos)
        end = pos
        while end < len(text) and text[end] not in ",}]<":
            end += 1
        if end >= len(text):
            raise IndexError(end)
        word = text[pos:end].strip()
        if not word:
            raise ValueError(f"no value at {pos}")
        try:
            return json.loads(word), end  # a number, true, false, null
        except json.JSONDecodeError:
            return word, end  # written bare, though a string


def skip_blanks(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def typed(value: str, schema: dict[str, Any] | None) -> str:
    """A parameter's text value as JSON text of the type its schema gives (a string where it
    gives none, or the text is not of that type)."""
    kinds = (schema or {}).get("type", "string")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    if "null" in kinds and value.strip() == "null":
        return "null"
    kind = next((k for k in kinds if k != "null"), "string")
    text = value.strip()
    try:
        if kind == "integer":
            return json.dumps(int(text))
        if kind == "number":
            number = float(text)
            return json.dumps(int(number) if number.is_integer() and "." not in text else number)
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower()
        if kind in ("object", "array"):
            decoded = json.loads(text)
            if isinstance(decoded, dict if kind == "object" else list):
                return json.dumps(decoded, ensure_ascii=False)
    except (ValueError, OverflowError):
        pass
    return json.dumps(value, ensure_ascii=False)


# The XML form before Hermes: both open with <tool_call>, and Hermes reads no call in it.
PARSERS: dict[str, ToolParser] = {
    "xml": XmlCallParser(),
    "hermes": HermesParser(),
    "gemma4": GemmaCallParser(),
    "llama3_json": Llama3JsonParser(),
}


def find_calls(text: str, schemas: Schemas | None = None) -> tuple[str, list[ToolCall]] | None:
    """The first registered format that finds calls in the text: its content and calls."""
    for parser in PARSERS.values():
        if (found := parser.parse(text, schemas)) is not None:
            return found
    return None


def scan_any(text: str, final: bool, schemas: Schemas | None = None) -> tuple[str | None, Scan]:
    """A stream's scan before it knows the format: the first parser that sees a call (the
    stream keeps to it), or none and how much of the text is content in every format."""
    scans = {name: parser.scan(text, final, schemas) for name, parser in PARSERS.items()}
    for name, (end, calls) in scans.items():
        if calls:
            return name, (end, calls)
    return None, (min(end for end, _ in scans.values()), [])
