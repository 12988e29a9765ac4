"""The request fields that constrain what the model writes (chapter 11).

``response_format`` (OpenAI's: ``text``, ``json_object``, or ``json_schema`` with a schema, strict
or not: the output always follows it) and ``structured_outputs`` (vLLM's extension: a JSON
Schema, JSON mode, a regex, a choice or a Lark grammar), both turned into the engine's
``StructuredOutputsParams`` (chapter 06), which constrained decoding (chapter 09b) enforces.
Strict models like the rest of the protocol: a wrong type or an unknown field is a 400.

Invariant: a field that asks for a constraint gives exactly one ``StructuredOutputsParams``;
whether its grammar compiles is checked before the request reaches the engine (``serving``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mini_infer.sampling_params import StructuredOutputsParams

# As every request model of ``protocol``: no "16" for 16, no unknown fields.
STRICT = ConfigDict(strict=True, extra="forbid")


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # none: any JSON value
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with "type": "json_schema", and only there')
        return self

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint it asks for (None for plain text)."""
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is not None:
            return StructuredOutputsParams(
                json=self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
            )
        return None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` extension: exactly one of these (``StructuredOutputsParams``)."""

    model_config = STRICT

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=bool(self.json_object),
        )
