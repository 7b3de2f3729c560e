"""Text to token ids and back, and the chat template, from a model folder's own files.

We read `tokenizer.json` with the `tokenizers` library (the Rust tokenizer that Hugging Face
uses underneath) and render the chat template with Jinja2 the way Hugging Face does, so
serving needs neither `transformers` nor a model hub.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

from minisgl.tokenizer.tools import kept_special_ids, tools_in_messages  # [ch25]


class Tokenizer:
    def __init__(self, model_path: str | Path) -> None:
        path = Path(model_path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path / 'tokenizer.json'} not found")
        # The `tokenizers` object itself, for what this class does not wrap.
        self.rust = RustTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else None
        self.chat_template: str | None = config.get("chat_template") or template
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        self.eos_token_ids = self._eos_ids(path)
        self.vocab_size = self.rust.get_vocab_size()
        # a tool-call form's special tokens, kept in the text; every special token  # [ch25]
        self.kept_ids, self.special_ids = kept_special_ids(self.rust, self.chat_template)  # [ch25]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.rust.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens and self.kept_ids:  # all but the call markers  # [ch25]
            ids = [i for i in ids if i in self.kept_ids or i not in self.special_ids]  # [ch25]
            skip_special_tokens = False  # [ch25]
        return self.rust.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt for a conversation; `variables` are what else the template reads (tools)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template: send plain completions instead")
        variables = with_effort(self.chat_template, variables)  # [ch25]
        if "tools" not in self.chat_template:  # it knows no tools: write them out  # [ch25]
            messages = tools_in_messages(messages, variables.pop("tools", None))  # [ch25]
        return _compile(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **variables,
        )

    def _eos_ids(self, path: Path) -> set[int]:
        # generation_config may name several stop tokens (an int or a list).
        ids: set[int] = set()
        eos = _read_json(path / "generation_config.json").get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.eos_token is not None and (i := self.rust.token_to_id(self.eos_token)) is not None:
            ids.add(i)
        return ids


# >>> ch25 a reasoning effort
def with_effort(template: str, variables: dict[str, Any]) -> dict[str, Any]:
    """A request's `reasoning_effort`, in the words its template reads: the name itself where
    the template reads it (gpt-oss's), else `enable_thinking` (Qwen3's, Qwen3.5's, Gemma 4's,
    SmolLM3's): off for "none", on for any other effort, for such a model thinks at one
    level. A template that reads neither cannot honour one: an error, not a dropped field."""
    effort = variables.get("reasoning_effort")
    if effort is None or "reasoning_effort" in template:
        return variables
    if "enable_thinking" not in template:
        raise ValueError(
            "this model's chat template reads no reasoning effort (neither reasoning_effort"
            " nor enable_thinking): leave it out"
        )
    on = effort != "none"
    if variables.get("enable_thinking", on) != on:
        asked = variables["enable_thinking"]
        raise ValueError(f"reasoning effort {effort!r} contradicts enable_thinking: {asked}")
    return {**variables, "enable_thinking": on}


# <<< ch25


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token: str | dict | None) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as {"content": ...}.
    return token.get("content") if isinstance(token, dict) else token


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    # The environment chat templates are written for: sandboxed, blocks trimmed, plus the
    # two helper functions templates call.
    if source not in _TEMPLATES:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
