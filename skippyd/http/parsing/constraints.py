"""Constrained output: ``response_format``, ``json_schema`` and ``grammar`` request fields.

Parsing here only checks shapes and picks the one constraint a request asks for; the
backend turns a schema into a grammar and checks that llama.cpp can parse the grammar
(both need llama.cpp, which the HTTP layer never imports).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from skippyd.http.api_errors import invalid_field, unsupported_field

logger = logging.getLogger(__name__)

#: Longest grammar or serialized schema accepted, in characters.
MAX_CONSTRAINT_CHARS = 64 * 1024


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """What the generated text must be."""

    kind: Literal["grammar", "json_schema", "json_object"]
    param: str
    """The request field it came from, for error messages."""
    grammar: str | None = None
    """GBNF text (``kind == "grammar"``)."""
    schema: dict[str, Any] | None = None
    """The JSON Schema (``kind == "json_schema"``)."""

    def schema_or_object(self) -> dict[str, Any]:
        """The schema to convert: the client's, or "any JSON object"."""
        return self.schema if self.schema is not None else {"type": "object"}


def parse_constraint(body: dict[str, Any]) -> OutputConstraint | None:
    """The request's output constraint, or None for free text.

    Raises:
        ApiError: 400 naming the field that is malformed, or both fields when two
            constraints are given.
    """
    found = [c for c in (_response_format(body.get("response_format")),
                         _json_schema_field(body.get("json_schema")),
                         _grammar_field(body.get("grammar"))) if c is not None]
    if len(found) > 1:
        names = " and ".join(c.param.split(".")[0] for c in found)
        raise invalid_field(found[1].param.split(".")[0],
                            f"{names} cannot be combined: give one constraint")
    return found[0] if found else None


def _response_format(value: Any) -> OutputConstraint | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_field("response_format", "must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")  # llama-server's extension: a schema beside json_object
        if schema is None:
            return OutputConstraint("json_object", "response_format")
        return OutputConstraint("json_schema", "response_format.schema",
                                schema=_schema(schema, "response_format.schema"))
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid_field("response_format.json_schema", "must be an object")
        param = "response_format.json_schema.schema"
        schema = spec.get("schema")
        return OutputConstraint("json_schema", param,
                                schema=_schema({} if schema is None else schema, param))
    if not isinstance(kind, str):
        raise invalid_field("response_format.type", "must be a string")
    raise unsupported_field("response_format.type", f"{kind!r}")


def _json_schema_field(value: Any) -> OutputConstraint | None:
    if value is None:
        return None
    return OutputConstraint("json_schema", "json_schema", schema=_schema(value, "json_schema"))


def _grammar_field(value: Any) -> OutputConstraint | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise invalid_field("grammar", "must be a non-empty GBNF grammar string")
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise invalid_field("grammar", f"longer than {MAX_CONSTRAINT_CHARS} characters")
    return OutputConstraint("grammar", "grammar", grammar=value)


def _schema(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid_field(param, "must be a JSON Schema object")
    if len(json.dumps(value)) > MAX_CONSTRAINT_CHARS:
        raise invalid_field(param, f"longer than {MAX_CONSTRAINT_CHARS} characters")
    return value
