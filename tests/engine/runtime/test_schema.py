"""JSON Schema to grammar: the converter's output parses, unsupported keywords are named."""

from __future__ import annotations

import pydantic
import pytest

from skippyd.engine.runtime.json_grammar import SchemaError, schema_to_grammar
from skippyd.engine.runtime.tokenizer import Tokenizer


class Address(pydantic.BaseModel):
    city: str
    zip_code: str | None = None


class Person(pydantic.BaseModel):
    name: str
    age: int
    tags: list[str]
    home: Address
    kind: str = pydantic.Field(json_schema_extra={"enum": ["a", "b"]})


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    tok = Tokenizer(tiny_model_path)
    yield tok
    tok.close()


def test_a_pydantic_schema_becomes_a_grammar_llama_cpp_parses(tokenizer):
    grammar = schema_to_grammar(Person.model_json_schema())
    assert grammar.startswith("") and "root ::=" in grammar
    assert '\\"home\\"' in grammar  # $defs/$ref resolved into rules
    tokenizer.check_grammar(grammar)


def test_json_object_and_scalars(tokenizer):
    for schema in ({"type": "object"}, {"type": "array", "items": {"type": "integer"},
                                        "maxItems": 3}, {"enum": [1, "x", None]},
                   {"type": ["string", "null"]}, {"type": "string", "format": "date"},
                   {"type": "string", "pattern": "^[a-z]+$", "description": "word"}):
        tokenizer.check_grammar(schema_to_grammar(schema))


@pytest.mark.parametrize(("schema", "path", "what"), [
    ({"type": "integer", "minimum": 0}, "minimum", "'minimum'"),
    ({"type": "object", "properties": {"age": {"type": "integer", "maximum": 9}}},
     "properties.age.maximum", "'maximum'"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems",
     "'uniqueItems'"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}, "anyOf[1].not", "'not'"),
    ({"type": "string", "format": "email"}, "format", "'email'"),
    ({"$ref": "https://example.com/schema.json"}, "$ref", "local references"),
    ({"type": "strin"}, "type", "unknown type"),
    ({"type": "string", "pattern": "[a-z]+"}, "pattern", "anchored"),
    ({"$defs": {"x": {"type": "number", "multipleOf": 2}}}, "$defs.x.multipleOf",
     "'multipleOf'"),
    ("not a schema", "", "JSON object"),
])
def test_unenforceable_keywords_are_named(schema, path, what):
    with pytest.raises(SchemaError) as excinfo:
        schema_to_grammar(schema)
    assert excinfo.value.path == path
    assert what in str(excinfo.value)


def test_a_broken_reference_is_a_schema_error():
    with pytest.raises(SchemaError, match="cannot be turned into a grammar"):
        schema_to_grammar({"$ref": "#/$defs/missing"})
