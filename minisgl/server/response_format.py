"""`response_format`: the output must be a JSON object, or JSON that a given schema accepts.

Chapter 25's request field. The server passes the schema on as text, and the scheduler
holds every sampled token to it (`scheduler/grammar.py`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator


class JsonSchema(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # `schema` is a BaseModel method's name
    strict: bool | None = None  # we always hold the output to the schema


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema: {"name", "schema"}')
        return self


def format_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema the output must satisfy; None: any text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    assert fmt.json_schema is not None  # `_schema_given`
    return fmt.json_schema.schema_


def schema_text(fmt: ResponseFormat | None) -> str | None:
    """The schema as text (ASCII: it travels well); None: any text."""
    schema = format_schema(fmt)
    return None if schema is None else json.dumps(schema)
