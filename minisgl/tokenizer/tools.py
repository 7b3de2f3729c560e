"""Tools for a chat template that knows none: the conversation rewritten in the Hermes form.

Qwen's, Llama 3's and Mistral's templates render `tools`, an assistant's `tool_calls` and
`tool` messages themselves. A template without them (SmolLM2's, a plain ChatML loop) would
drop the tools and fail on a message whose content is null. For such a template the worker
writes the tools into the system message with the `<tool_call>` instructions that Hermes
and Qwen models are trained on, an assistant's calls as `<tool_call>` blocks and a tool's
result as a `<tool_response>` block, all plain text that any template renders, and that
the server's Hermes parser reads back.
"""

from __future__ import annotations

import json
from typing import Any

INSTRUCTIONS = """You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def tools_in_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation with its tools, calls and results written as text (no-op without)."""
    if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            blocks = [json.dumps(c["function"], ensure_ascii=False) for c in m["tool_calls"]]
            calls = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
            content = f"{content}\n{calls}" if content else calls
        elif m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        text = INSTRUCTIONS.format(tools=listed)
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


# Special tokens that a template's forms write inside an answer (Gemma 4's call markers,
# string quotes and thought channel): they stay in the answer's text, where the server's
# parsers read them, though the request asks special tokens to be skipped.
KEPT_MARKERS = ("<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>")


def kept_special_ids(rust: Any, template: str | None) -> tuple[set[int], set[int]]:
    """(the ids of the call markers `template` writes, the ids of every special token)."""
    specials = {i for i, t in rust.get_added_tokens_decoder().items() if t.special}
    marks = [m for m in KEPT_MARKERS if template and m in template]
    kept = {i for m in marks if (i := rust.token_to_id(m)) is not None and i in specials}
    return kept, specials
