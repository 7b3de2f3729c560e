"""vLLM's POST /tokenize and /detokenize: a prompt's token ids as this server would serve it.

A router that places requests by the KV cache each replica holds (vllm-router's kv_aware
policy, which reads our KV-cache events) must know a request's token ids before it picks a
worker. It asks a worker: POST /tokenize with the chat request's `messages` (or a
completion's `prompt`), and compares the ids with the blocks each replica has published.
Clients use the same endpoint to count tokens against the context length.

The ids must be the ones the request will be served with, so this is the tokenizer
worker's computation, in the HTTP process: the same Tokenizer class and chat template,
the same template variables, the special tokens left to the template. The tokenizer is
loaded on the first call (in a thread, so that the event loop keeps serving).

    {"prompt": "Hello"}                                  -> {"count": 2, "tokens": [...], ...}
    {"messages": [{"role": "user", "content": "Hi"}]}    -> the chat prompt's ids
    {"tokens": [...]} to /detokenize                     -> {"prompt": "..."}

and vLLM's newer /v1/chat/completions/render and /v1/completions/render, which take the
body of a chat or completion request and answer it as token ids (vLLM's GenerateRequest:
`request_id`, `token_ids`, `sampling_params`, `model`, `stream`; a list, one per prompt,
for completions). vllm-router asks /render first, and /tokenize where that is a 404.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from minisgl.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    check_model,
)
from minisgl.tokenizer.tokenizer import Tokenizer


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's other fields (tools, mm...) unread

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for a chat
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message goes on: no end of its turn
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def chat_ids(
    tok: Tokenizer,
    chat: ChatCompletionRequest,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> list[int]:
    """The ids of a chat prompt, as the tokenizer worker makes them for /v1/chat/completions
    (its tools in the template too)."""
    if continue_final_message and add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt exclude each other")
    messages = chat.plain_messages()
    try:
        text = tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **chat.template_vars()
        )
    except Exception as e:  # a template may reject a conversation (e.g. roles out of order)
        raise APIError(400, f"the chat template rejected the messages: {e}") from None
    if continue_final_message:  # cut what the template wrote after the last message
        last = messages[-1]["content"] or ""
        end = text.rfind(last)
        if end < 0:
            raise APIError(400, "the final message is not in the rendered prompt")
        text = text[: end + len(last)]
    return tok.encode(text, add_special_tokens=add_special_tokens)


SAMPLING = {"temperature", "top_p", "top_k", "n", "stop", "seed", "max_tokens"}


def rendered(kind: str, ids: list[int], body: ChatCompletionRequest | CompletionRequest) -> dict:
    """vLLM's GenerateRequest: what /render answers, a request as token ids."""
    return {
        "request_id": f"{kind}-{uuid.uuid4().hex}",
        "token_ids": ids,
        "sampling_params": body.model_dump(include=SAMPLING, exclude_none=True),
        "model": body.model,
        "stream": body.stream,
    }


def add_tokenize_routes(
    app: FastAPI, model_path: str, names: tuple[str, ...], max_model_len: int
) -> None:
    loaded: list[Tokenizer] = []
    lock = asyncio.Lock()

    async def tokenizer() -> Tokenizer:
        async with lock:
            if not loaded:
                loaded.append(await asyncio.to_thread(Tokenizer, model_path))
        return loaded[0]

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model, names)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either `prompt` or `messages`")
        tok = await tokenizer()
        if body.messages is not None:
            if not body.messages:
                raise APIError(400, "`messages` is empty", "messages")
            chat = ChatCompletionRequest(model=names[0], messages=body.messages)
            flags = (body.add_generation_prompt, body.continue_final_message)
            ids = chat_ids(tok, chat, *flags, bool(body.add_special_tokens))
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tok.encode(body.prompt or "", add_special_tokens=special)
        strs = [tok.rust.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    # vLLM's newer form of the same question, asked first by vllm-router: the body of a
    # chat or completion request, answered as the request in token ids (one per prompt).
    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict[str, Any]:
        check_model(body.model, names)
        return rendered("chatcmpl", chat_ids(await tokenizer(), body), body)

    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest) -> list[dict[str, Any]]:
        check_model(body.model, names)
        tok = await tokenizer()
        prompts = body.prompts()
        ids = [p if isinstance(p, list) else tok.encode(p) for p in prompts]
        return [rendered("cmpl", i, body) for i in ids]

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        check_model(body.model, names)
        tok = await tokenizer()
        bad = [t for t in body.tokens if not 0 <= t < tok.rust.get_vocab_size(True)]
        if bad:
            raise APIError(400, f"token ids out of the vocabulary: {bad[:5]}", "tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}
