"""Copies of protocol messages with some fields changed, made through their JSON form: only ``to_json`` and
``from_json`` are used, so this does not depend on the class behind a message."""

from __future__ import annotations

import json
from typing import Any, TypeVar

M = TypeVar("M")


def updated(message: M, **changes: Any) -> M:
    """A copy of ``message`` with ``changes``; a value that is itself a message is nested as its JSON."""
    data = json.loads(message.to_json())
    for name, value in changes.items():
        data[name] = json.loads(value.to_json()) if hasattr(value, "to_json") else value
    return type(message).from_json(json.dumps(data))
