"""The JSON schema a chat answer must follow when it must, or may, call tools.

With `tool_choice` naming a function, the answer is that function's arguments and nothing
else, so the grammar is the function's own `parameters` schema: its `$ref`s resolve as
their author meant. With "required", the answer is a JSON array of calls,
`[{"name": ..., "arguments": ...}, ...]` (one call at most with `parallel_tool_calls`
false). With "auto" and a `response_format`, it is such an array or a document of the
format: the model decides, and its first character says which ("[" or "{").

A schema nested inside another no longer sits at the root its `$ref`s point into:
`#/$defs/User` in a tool's parameters (what pydantic writes for any nested model) would be
looked up in the wrapper. So each nested schema moves whole under the wrapper's `$defs`
with its local references rewritten to its new place (`#/$defs/<key>/$defs/User`); a
reference to its root (`#`, a recursive schema) follows it too.
"""

from __future__ import annotations

from typing import Any

# Keywords whose values are data, not schemas: a "$ref" inside them is not a reference.
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def moved(schema: Any, root: str) -> Any:
    """The schema with each local `$ref` rewritten for a schema that now lives at `root`."""
    if isinstance(schema, list):
        return [moved(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = root + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = moved(value, root)
    return out


class Nested:
    """A wrapper schema's `$defs`, where the schemas nested in it keep their references."""

    def __init__(self) -> None:
        self.defs: dict[str, Any] = {}

    def ref(self, key: str, schema: dict[str, Any]) -> dict[str, Any]:
        """A reference to `schema`, moved under the wrapper's `$defs` as `key`."""
        self.defs[key] = moved(schema, f"#/$defs/{key}")
        return {"$ref": f"#/$defs/{key}"}

    def root(self, schema: dict[str, Any]) -> dict[str, Any]:
        return {**schema, "$defs": self.defs} if self.defs else schema


def calls_schema(tools: list[tuple[str, dict[str, Any]]], parallel: bool, nested: Nested) -> dict:
    """An array of calls to these (name, parameters) functions; one call without `parallel`."""
    forms = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": nested.ref(f"tool{i}", params)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, (name, params) in enumerate(tools)
    ]
    items = forms[0] if len(forms) == 1 else {"anyOf": forms}
    array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return array


def answer_schema(
    tools: list[tuple[str, dict[str, Any]]],
    choice: str,
    parallel: bool,
    response: dict[str, Any] | None,
) -> dict[str, Any] | None:
    """What the answer must be, for tools as (name, parameters) pairs; None: free text.

    `choice` is "none", "auto", "required" or the name of the function to call;
    `response` is the response_format's schema, if any."""
    if choice == "none" or not tools:
        return response
    if choice == "auto" and response is None:
        return None
    if choice not in ("auto", "required"):
        return next(params for name, params in tools if name == choice)
    nested = Nested()
    calls = calls_schema(tools, parallel, nested)
    if choice == "required":
        return nested.root(calls)
    assert response is not None
    return nested.root({"anyOf": [calls, nested.ref("response", response)]})
