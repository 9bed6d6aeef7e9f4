"""JSON Schema to GBNF, with llama-cpp-python's converter and an honest front door.

The conversion itself is llama-cpp-python's :class:`~llama_cpp.llama_grammar.SchemaConverter`
(a port of llama.cpp's own). That converter silently drops keywords it does not know
(``minimum``, ``uniqueItems``, ``not``…), so a client would get output that breaks its own
schema without a word. :func:`schema_to_grammar` therefore walks the schema first and
refuses any keyword the grammar would not enforce, naming where it is.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

from llama_cpp.llama_grammar import SchemaConverter

logger = logging.getLogger(__name__)

#: Keywords the converter turns into grammar rules.
ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
    "definitions", "pattern", "format", "minLength", "maxLength",
})
#: Keywords that describe rather than constrain: accepted and ignored.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "readOnly", "writeOnly", "deprecated", "discriminator",
})
#: ``format`` values the converter enforces.
FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3",
                     "uuid4", "uuid5"})
TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})
#: Deepest schema nesting accepted (recursion in both the check and the converter).
MAX_DEPTH = 64


class SchemaError(ValueError):
    """A schema the grammar cannot enforce.

    Attributes:
        path: Where in the schema, e.g. ``properties.age.minimum``.
        reason: What is wrong.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason


def schema_to_grammar(schema: Any, root: str | None = None) -> str:
    """Convert a JSON Schema to a GBNF grammar whose start rule is ``root``.

    Args:
        schema: The decoded schema (a JSON object).
        root: A GBNF expression for the start rule around the value, which it names
            ``call`` (a tool call's wrapping); None makes the value itself the start.

    Returns:
        The grammar text.

    Raises:
        SchemaError: Naming the first keyword or value the grammar cannot enforce.
    """
    check_schema(schema)
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False,
                                raw_pattern=False)
    try:
        resolved = converter.resolve_refs(copy.deepcopy(schema), "input")
        if root is None:
            converter.visit(resolved, "")
        else:
            # A fresh converter names the value's rule "call", as asked.
            if converter.visit(resolved, "call") != "call":
                raise ValueError("the schema's rule could not be named 'call'")
            converter._add_rule("root", root)
    except (AssertionError, ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
        raise SchemaError("", f"cannot be turned into a grammar: {exc}") from None
    return converter.format_grammar()


def check_schema(schema: Any, path: str = "", depth: int = 0) -> None:
    """Raise :class:`SchemaError` at the first keyword the grammar would not enforce."""
    if isinstance(schema, bool):
        raise SchemaError(path, "boolean schemas are not supported")
    if not isinstance(schema, dict):
        raise SchemaError(path, "must be a JSON object")
    if depth > MAX_DEPTH:
        raise SchemaError(path, f"nested deeper than {MAX_DEPTH} levels")
    for key, value in schema.items():
        where = f"{path}.{key}" if path else key
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise SchemaError(where, f"the keyword {key!r} is not supported")
        _check_value(key, value, where)
    for child, where in _subschemas(schema, path):
        check_schema(child, where, depth + 1)


def _check_value(key: str, value: Any, where: str) -> None:
    if key == "type":
        kinds = value if isinstance(value, list) else [value]
        bad = [kind for kind in kinds if kind not in TYPES]
        if bad or not kinds:
            raise SchemaError(where, f"unknown type {bad[0] if bad else value!r}")
    elif key == "format" and value not in FORMATS:
        raise SchemaError(where, f"the format {value!r} is not supported "
                                 f"(supported: {', '.join(sorted(FORMATS))})")
    elif key == "$ref" and not (isinstance(value, str) and value.startswith("#/")):
        raise SchemaError(where, f"only local references ('#/...') are supported (got {value!r})")
    elif key == "required" and not (isinstance(value, list)
                                    and all(isinstance(v, str) for v in value)):
        raise SchemaError(where, "must be a list of property names")
    elif key in ("anyOf", "oneOf", "allOf", "prefixItems") and not (
            isinstance(value, list) and value):
        raise SchemaError(where, "must be a non-empty list of schemas")
    elif key in ("properties", "$defs", "definitions") and not isinstance(value, dict):
        raise SchemaError(where, "must be an object of schemas")
    elif key == "pattern" and not (isinstance(value, str) and value.startswith("^")
                                   and value.endswith("$")):
        raise SchemaError(where, "patterns must be anchored: start with '^' and end with '$'")


def _subschemas(schema: dict[str, Any], path: str) -> Iterator[tuple[Any, str]]:
    prefix = f"{path}." if path else ""
    for key in ("properties", "$defs", "definitions"):
        for name, child in (schema.get(key) or {}).items():
            yield child, f"{prefix}{key}.{name}"
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for index, child in enumerate(schema.get(key) or ()):
            yield child, f"{prefix}{key}[{index}]"
    items = schema.get("items")
    if isinstance(items, list):
        for index, child in enumerate(items):
            yield child, f"{prefix}items[{index}]"
    elif items is not None:
        yield items, f"{prefix}items"
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        yield extra, f"{prefix}additionalProperties"
