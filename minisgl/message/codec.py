"""msgpack encoding of our message dataclasses: plain data on the wire, never pickle.

Each message is a map with its type's name under "_t"; nested dataclasses (the
SamplingParams inside a request) are encoded the same way. Only the types registered
here can be decoded, so a peer cannot make us build arbitrary objects: the dataclasses
that the message modules define or import, which are the messages and what they carry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from minisgl.message import backend, frontend

_TYPES: dict[str, type] = {
    cls.__name__: cls
    for module in (backend, frontend)
    for cls in vars(module).values()
    if isinstance(cls, type) and dataclasses.is_dataclass(cls)
}


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        plain = {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        plain["_t"] = type(obj).__name__
        return plain
    if isinstance(obj, list | tuple):
        return [_to_plain(x) for x in obj]
    return obj


def _from_plain(obj: dict[str, Any]) -> Any:
    name = obj.pop("_t", None)
    if name is None:
        return obj
    if name not in _TYPES:
        raise ValueError(f"unknown message type {name!r}")
    return _TYPES[name](**obj)


def encode(msg: Any) -> bytes:
    return msgpack.packb(_to_plain(msg), use_bin_type=True)


def decode(data: bytes) -> Any:
    # Maps may have integer keys (a logit_bias is token id -> bias); only the type whitelist
    # above decides what objects get built.
    return msgpack.unpackb(data, raw=False, object_hook=_from_plain, strict_map_key=False)
