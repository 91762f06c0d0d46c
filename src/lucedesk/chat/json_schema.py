"""JSON schemas as the grammar can hold them. A schema a client sends (a tool's parameters, a
response format) may use keywords llguidance does not implement; keywords that only narrow
what is valid (`propertyNames`, `uniqueItems`, `not`, an unknown `format`...) are left out of
the grammar, which then allows a little more, and the output is validated against the whole
schema after it is written. Number bounds the grammar cannot write are dropped where dropping
only loosens, and refused where no number it can write would satisfy them.

    grammar = schema_grammar(schema, "tools[0]") # a Grammar; RequestError naming a bound
    loose = grammar_schema(schema, "tools[0]")   # raises RequestError naming the bound
    loose.schema, loose.dropped                   # what the grammar gets; keywords left out
    problem = check_value(schema, value)          # after generation: None, or what is wrong
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

from lucedesk.engine import Grammar
from lucedesk.errors import RequestError

log = logging.getLogger(__name__)

# Keywords llguidance refuses that only narrow what a value may be.
NARROWING = frozenset(
    {
        "propertyNames",
        "contains",
        "minContains",
        "maxContains",
        "uniqueItems",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "not",
        "if",
        "then",
        "else",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)
# String formats the grammar writes; any other format is an annotation to it.
FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"}
)
# The grammar writes numbers within +-(2^53 - 1), the integers JSON holds exactly.
LIMIT = 2**53 - 1
LOWER = ("minimum", "exclusiveMinimum")
UPPER = ("maximum", "exclusiveMaximum")

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("additionalProperties", "items", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")

_logged: set[frozenset[str]] = set()


@dataclass(slots=True, frozen=True)
class LooseSchema:
    schema: object  # what the grammar is built from
    dropped: frozenset[str]  # keywords left out of it (validated after generation)


def grammar_schema(schema: object, field: str) -> LooseSchema:
    """`schema` as the grammar can hold it. Raises RequestError naming a bound no number the
    grammar writes can meet (`tools[0].properties.n.minimum`)."""
    dropped: set[str] = set()
    loose = _loosen(schema, field, dropped)
    if dropped and frozenset(dropped) not in _logged:
        _logged.add(frozenset(dropped))
        log.info(
            "schema keywords %s are checked after generation, not by the grammar (first in %s)",
            ", ".join(sorted(dropped)),
            field,
        )
    return LooseSchema(loose, frozenset(dropped))


def schema_grammar(schema: dict | bool, field: str = "response_format") -> Grammar:
    """The grammar for output matching `schema`: what of it the grammar can hold, with the
    whole schema kept as its `strict` when that is more. Raises RequestError naming a bound
    the grammar cannot meet."""
    loose = grammar_schema(schema, field)
    strict = json.dumps(schema) if loose.dropped else None
    return Grammar("json_schema", json.dumps(loose.schema), field, strict)


def json_object(field: str = "response_format") -> Grammar:
    """The grammar for output that is any JSON object."""
    return schema_grammar({"type": "object"}, field)


def check_value(schema: object, value: object) -> str | None:
    """None when `value` satisfies `schema`, else the first problem jsonschema names."""
    import jsonschema

    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except (jsonschema.exceptions.SchemaError, TypeError, ValueError) as exc:
        return f"the schema cannot be checked: {exc}"
    if error is None:
        return None
    where = "".join(f"[{p!r}]" for p in error.absolute_path)
    return f"{where or 'the value'}: {error.message}"


def _loosen(schema: object, path: str, dropped: set[str]) -> object:
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in NARROWING:
            dropped.add(key)
        elif key == "format" and isinstance(value, str) and value not in FORMATS:
            dropped.add(f"format {value}")
        elif key in LOWER + UPPER and _out_of_range(key, value, f"{path}.{key}"):
            dropped.add(key)
        elif key in ("minProperties", "maxProperties") and not _all_required(schema):
            dropped.add(key)  # the grammar bounds properties only when all are required
        elif key in _ONE and not isinstance(value, list):
            out[key] = _loosen(value, f"{path}.{key}", dropped)
        elif key in _LIST + _ONE and isinstance(value, list):  # draft-07 tuple `items` too
            out[key] = [_loosen(v, f"{path}.{key}[{i}]", dropped) for i, v in enumerate(value)]
        elif key in _MAP and isinstance(value, dict):
            out[key] = {k: _loosen(v, f"{path}.{key}.{k}", dropped) for k, v in value.items()}
        else:
            out[key] = value
    return out


def _out_of_range(key: str, value: object, path: str) -> bool:
    """True for a bound beyond what the grammar writes that only loosens when dropped (a
    minimum below -LIMIT); raises RequestError for one nothing it writes can meet."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False  # not a number: the grammar library names it
    if math.isnan(value) or abs(value) <= LIMIT:
        return False
    lower = key in LOWER
    if (value < 0) == lower:  # a lower bound far below, an upper bound far above
        return True
    raise RequestError(
        f"{path}: {value:g} is beyond the numbers constrained output can write "
        f"(-{LIMIT} to {LIMIT})",
        path,
    )


def _all_required(schema: dict) -> bool:
    properties = schema.get("properties") or {}
    required = schema.get("required") or []
    return isinstance(properties, dict) and set(properties) <= set(required)
