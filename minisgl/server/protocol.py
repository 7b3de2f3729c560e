"""The OpenAI request bodies we accept, validated field by field, and the error we answer.

Fields we do not know are ignored, as OpenAI-compatible servers do; fields we know must
have the right type and range, or the client gets a 400 naming the field. Ranges are
OpenAI's. Whatever passes here must also cross our msgpack pipes: integers fit in 64 bits
and text is valid Unicode, so that nothing reaches the workers that they could choke on.
Every refusal has OpenAI's error shape (`APIError.body`), so that clients written for
OpenAI show the message.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from minisgl.engine.limits import UNLIMITED
from minisgl.sampling_params import SamplingParams
from minisgl.server import limits
from minisgl.server import tools as calling  # [ch25]
from minisgl.server.response_format import ResponseFormat, schema_text  # [ch25]

INT64_END = 1 << 63  # msgpack carries integers of up to 64 bits; prompts and params stay below
MAX_PROMPTS = limits.MAX_PROMPTS


def _unicode(text: str) -> str:
    # JSON can spell a lone surrogate ("\ud800"); UTF-8, and so msgpack, cannot carry one.
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("the text holds a lone surrogate (\\ud800-\\udfff): not Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
Stop = Annotated[str, Field(max_length=limits.MAX_STOP_CHARS), AfterValidator(_unicode)]
TokenId = Annotated[int, Field(ge=0, lt=INT64_END)]  # the vocabulary's bound is the server's
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]  # added to a logit
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]  # OpenAI's  # [ch25]


class APIError(Exception):
    """A refusal, in OpenAI's error shape; the server answers it with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str | None = None,  # by default, the client's error below 500, else ours
        code: str | None = None,
        retry_after: int | None = None,  # seconds, for a 503: the Retry-After header
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status,
            _printable(message),
            None if param is None else _printable(param),
            kind or ("invalid_request_error" if status < 500 else "server_error"),
            code,
        )
        self.headers = {} if retry_after is None else {"Retry-After": str(retry_after)}

    def body(self) -> dict[str, Any]:
        err = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return {"error": err}


def check_model(name: str | None, names: tuple[str, ...]) -> None:
    """A request that names a model must name the served one (`names[0]`) or an alias."""
    if name is not None and name not in names:
        message = f"model {name!r} does not exist; this server has {names[0]!r}"
        raise APIError(404, message, "model", code="model_not_found")


def _printable(text: str) -> str:
    # A message may quote the client's input; a lone surrogate in it could not be sent as UTF-8.
    return text.encode("utf-8", "backslashreplace").decode()


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, lt=INT64_END)
    n: int = Field(1, ge=1, le=limits.MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=limits.MAX_STOPS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = Field(None, ge=0, lt=INT64_END)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    skip_special_tokens: bool = True
    logit_bias: Annotated[dict[TokenId, Bias], Field(max_length=limits.MAX_LOGIT_BIAS)] | None = (
        None
    )
    response_format: ResponseFormat | None = None  # [ch25]

    @field_validator("response_format", mode="before")  # [ch25]
    @classmethod  # [ch25]
    def _schema_size(cls, v: Any) -> Any:  # [ch25]
        return limits.check_schema_size(v, "response_format")  # [ch25]

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (no limit) or >= 1")
        return v

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def token_ids(self) -> dict[str, list[int]]:
        """The token ids the request names, by field: each must be in the model's vocabulary."""
        return {
            "stop_token_ids": list(self.stop_token_ids or []),
            "logit_bias": list(self.logit_bias or {}),
        }

    def sampling_params(self, max_tokens: int | None, i: int) -> SamplingParams:
        seed = None if self.seed is None else (self.seed + i) % 2**63  # n choices must differ
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_tokens=max_tokens or UNLIMITED,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []),
            seed=seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias or {}),  # [ch25]
            json_schema=self.output_schema(),  # [ch25]
            **self.logprob_params(),
        )

    def logprob_params(self) -> dict[str, Any]:
        raise NotImplementedError  # each endpoint asks for them its own way

    def output_schema(self) -> str | None:  # [ch25]
        return schema_text(self.response_format)  # [ch25]


class CompletionRequest(_Common):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    echo: bool = False  # the prompt comes back before the completion
    max_tokens: int | None = Field(16, ge=0, lt=INT64_END)  # 0 with echo: score the prompt
    logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("max_tokens")
    @classmethod
    def _zero_with_echo(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be >= 1 (0 only with echo, to score the prompt)")
        return v

    def max_new_tokens(self) -> int | None:
        # A prefill always samples a token: with max_tokens 0 one is made, and not shown.
        return 1 if self.max_tokens == 0 else self.max_tokens

    def logprob_params(self) -> dict[str, Any]:
        return {
            "logprobs": self.logprobs is not None,  # logprobs N: the chosen token's,
            "top_logprobs": self.logprobs or 0,  # and the N likeliest  # [ch25]
            "prompt_logprobs": self.echo and self.logprobs is not None,  # and echo's  # [ch25]
        }

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        # A list of texts, or of token-id lists, is a batch: each prompt runs as its own request.
        batch = v if isinstance(v, list) and v and isinstance(v[0], str | list) else [v]
        if len(batch) > MAX_PROMPTS:
            raise ValueError(f"{len(batch)} prompts in one request; send at most {MAX_PROMPTS}")
        if not all(batch):
            raise ValueError("the prompt is empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one or a batch; each gets n choices, indexed prompt-major."""
        p = self.prompt
        return list(p) if isinstance(p, list) and isinstance(p[0], str | list) else [p]

    @model_validator(mode="after")
    def _choices(self) -> CompletionRequest:
        if (total := len(self.prompts()) * self.n) > MAX_PROMPTS:
            message = f"{total} choices (prompts times n); at most {MAX_PROMPTS} per request"
            raise ValueError(message)
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[dict[str, Any]] | None = None
    tool_calls: list[calling.AssistantCall] | None = None  # an assistant's, sent back  # [ch25]
    tool_call_id: str | None = None  # a tool's result answers this call  # [ch25]
    reasoning_content: Text | None = None  # an assistant's, sent back  # [ch25]

    @model_validator(mode="after")
    def _text_only(self) -> ChatMessage:
        self.text()  # raises for parts that are not text
        return self

    def text(self) -> str:
        if self.content is None:
            if self.tool_calls:  # an assistant's calls stand in for its text  # [ch25]
                return ""  # [ch25]
            raise ValueError("the message has no content")
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(_unicode(part["text"]))
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, lt=INT64_END)
    max_completion_tokens: int | None = Field(None, ge=1, lt=INT64_END)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    # Refused where the validator below does not take them: a request with tools is never
    # answered as if it had none.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None  # the deprecated spelling of tools
    function_call: Any = None
    parallel_tool_calls: bool = True  # [ch25]
    # more variables for the chat template, e.g. {"enable_thinking": false}  # [ch25]
    chat_template_kwargs: dict[str, Any] | None = None  # [ch25]
    # how hard a thinking model thinks: "none" turns thinking off (with_effort)  # [ch25]
    reasoning_effort: Effort | None = None  # [ch25]

    @field_validator("chat_template_kwargs")  # [ch25]
    @classmethod  # [ch25]
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:  # [ch25]
        return check_template_kwargs(v)  # [ch25]

    @field_validator("tools", mode="before")  # [ch25]
    @classmethod  # [ch25]
    def _tools_size(cls, v: Any) -> Any:  # [ch25]
        return limits.check_tools(v)  # [ch25]

    @field_validator("tools", "tool_choice", "functions", "function_call")
    @classmethod
    def _no_tools(cls, v: Any, info: ValidationInfo) -> Any:
        if info.field_name in ("tools", "tool_choice"):  # [ch25]
            return calling.check_tools(info.field_name, v, info.data)  # [ch25]
        if v is not None:
            raise ValueError(f"{info.field_name} is not supported by this server; leave it out")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_params(self) -> dict[str, Any]:
        return {
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs or 0,  # [ch25]
        }

    def plain_messages(self) -> list[dict[str, Any]]:
        plain: list[dict[str, Any]] = [{"role": m.role, "content": m.text()} for m in self.messages]
        calling.add_tool_fields(plain, self.messages)  # [ch25]
        return plain

    # >>> ch25 tools
    def output_schema(self) -> str | None:
        fmt = self.response_format
        return calling.answer_grammar(self.tools, self.tool_choice, self.parallel_tool_calls, fmt)

    def tool_output(self) -> calling.ToolOutput | None:
        formatted = schema_text(self.response_format) is not None
        parallel = self.parallel_tool_calls
        return calling.tool_output(self.tools, self.tool_choice, parallel, formatted)

    def template_vars(self) -> dict[str, Any]:
        tools = calling.template_tools(self.tools, self.tool_choice)
        variables = dict(self.chat_template_kwargs or {})
        if tools is not None:
            variables["tools"] = tools
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
        return variables

    # <<< ch25


# >>> ch25 the chat template's own variables
# What the server itself gives the template: a request may not set these.
TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
TEMPLATE_OWN += ("reasoning_effort",)


def check_template_kwargs(v: dict[str, Any] | None) -> dict[str, Any] | None:
    """`chat_template_kwargs`: names a template can read, none of those the server sets."""
    for name in v or {}:
        if not name.isidentifier():
            raise ValueError(f"{name!r} is not a name a chat template can read")
        if name in TEMPLATE_OWN:
            raise ValueError(f"{name!r} is set by the server; send it in its own field")
    return v


# <<< ch25
