"""How answers look: completions or chat, whole or as streamed chunks, in OpenAI's shapes."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from minisgl.server.frontend import Choice
from minisgl.server.logprobs import add_chat_details, add_echo, completion_details  # [ch25]
from minisgl.server.reasoning import Reasoning  # [ch25]
from minisgl.server.tools import ToolOutput  # [ch25]


class ResponseShape:
    """The shape of one request's answer; its id and time are fixed when it is made."""

    def __init__(self, chat: bool, model: str, logprobs: Any) -> None:
        # Chat asks with `true`; completions with a number, 0 meaning the chosen token's only.
        self.chat, self.model = chat, model
        self.logprobs = logprobs is not None and logprobs is not False
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.tools: ToolOutput | None = None  # where the answer may hold tool calls  # [ch25]
        self.reasoning: Reasoning | None = None  # a thinking model's, apart  # [ch25]

    def usage(self, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
        completion = sum(c.tokens for c in choices)
        # The n choices share one prompt, counted once (as OpenAI does).
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }
        if self.reasoning is not None:  # [ch25]
            thought = sum(self.reasoning.tokens.values())  # [ch25]
            usage["completion_tokens_details"] = {"reasoning_tokens": thought}  # [ch25]
        return usage

    def _logprobs(self, c: Choice, start: int) -> Any:
        """The logprobs of the choice's tokens from `start` on, in the endpoint's shape."""
        if not self.logprobs:
            return None
        values, tokens = c.logprobs[start:], c.token_texts[start:]
        if self.chat:
            content = [
                {"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
                for t, v in zip(tokens, values)
            ]
            add_chat_details(content, c.full.details[start:])  # [ch25]
            return {"content": content}
        out: dict[str, Any] = {
            "token_logprobs": values,
            "tokens": tokens,
            "top_logprobs": None,
            "text_offset": None,
        }
        out.update(completion_details(c.full, start))  # [ch25]
        return out

    def full(self, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            text = "".join(c.text)
            body: dict[str, Any] = {
                "index": c.index,
                "finish_reason": c.finish_reason,
                "logprobs": self._logprobs(c, 0),
            }
            if self.chat:
                body["message"] = {"role": "assistant", "content": text}
                if self.reasoning is not None:  # [ch25]
                    split = self.reasoning.whole(c.text, c.index, c.tokens)  # [ch25]
                    thought, body["message"]["content"] = split  # [ch25]
                    body["message"]["reasoning_content"] = thought or None  # [ch25]
                if self.tools is not None:  # [ch25]
                    self.tools.whole(body)  # [ch25]
            else:
                body["text"] = text
            add_echo(body, c.full, self.logprobs)  # [ch25]
            out.append(body)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": out,
            "usage": self.usage(choices, prompt_tokens),
        }

    def chunk_choice(self, index: int, delta: dict[str, Any], finish: str | None) -> dict:
        return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}

    def delta_choice(self, c: Choice, text: str, logprobs: list[float]) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if self.reasoning is not None:  # [ch25]
                final = c.finish_reason is not None  # [ch25]
                split = self.reasoning.stream(c.index, text, final, c.tokens)  # [ch25]
                thought, delta["content"] = split  # [ch25]
                if thought:  # [ch25]
                    delta["reasoning_content"] = thought  # [ch25]
            body = self.chunk_choice(c.index, delta, c.finish_reason)
            if self.tools is not None:  # [ch25]
                self.tools.delta(c.index, body)  # [ch25]
        else:
            body = {"index": c.index, "text": text, "finish_reason": c.finish_reason}
        body["logprobs"] = self._logprobs(c, len(c.logprobs) - len(logprobs))
        return body

    def event(self, choices: list[dict], usage: dict[str, Any] | None = None) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"
