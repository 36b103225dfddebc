"""How a user's regex or JSON schema is read: as vLLM's default grammar backend (xgrammar)
and OpenAI read it, where llguidance's own reading would differ.

Where it sits: `structured_output.grammar_for` passes every `regex` and `json` constraint
through here before llguidance compiles it (front-end validation and the engine core
alike), so what is checked is what runs. Pure functions on strings and dicts; jax-free.

Two readings differ, and both show with a real model:
- A regex's `\\d` and `\\w` are Unicode classes in llguidance (Rust's regex syntax), so a
  date pattern `\\d{4}-\\d{2}-\\d{2}` lets a model write digits of any script (SmolLM2 wrote
  "🯸🯸🯸🯸-🯸🯸-"). In xgrammar, JavaScript and JSON Schema's `pattern` (which llguidance
  already reads so) they are ASCII: `[0-9]` and `[0-9A-Za-z_]`. `\\s` is Unicode in all.
- A JSON schema's object that lists its properties and says nothing of others allows any
  other key by the letter of JSON Schema, and llguidance follows it: SmolLM2, forced to
  call `get_weather(city)`, added `"location"` and `"description"`. xgrammar's default
  strict mode (vLLM's) and OpenAI's strict schemas allow only the listed keys, so such an
  object is closed here (`"properties": {}`, as a tool without parameters has, allows only
  `{}`). A schema that says `additionalProperties` (or `unevaluatedProperties`) keeps its
  word; an object schema without `properties` stays any object; and what adds properties
  up stays open: the parts of an `allOf`, a schema beside its `$ref` and the definition
  it names, a schema beside `anyOf`/`oneOf` branches of their own properties. Such a
  branch is closed with the schema's own properties counted as its own. A closed object's
  `required` names count as listed.
"""

from __future__ import annotations

# Each shorthand as a bracketed class, which reads the same outside a class and nested
# inside one (`[^\d]` -> `[^[0-9]]`: Rust's syntax unions nested classes).
_ASCII_SHORTHANDS = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("items", "additionalProperties", "contains", "propertyNames")
_LIST = ("prefixItems", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def ascii_shorthands(regex: str) -> str:
    """`regex` with `\\d \\D \\w \\W` as ASCII classes; every other escape as written."""
    out = []
    i = 0
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            out.append(_ASCII_SHORTHANDS.get(escaped, char + escaped))
            i += 2
        else:
            out.append(char)
            i += 1
    return "".join(out)


def closed_objects(schema: dict) -> dict:
    """A copy of `schema` whose objects that list properties (none, too) allow no others,
    unless they say so. `not`, `if`/`then`/`else` and the like are copied as they are (closing an
    object under `not` would widen what it allows)."""
    merged_refs = set()
    _collect_merged_refs(schema, merged_refs)
    return _closed(schema, merged_refs, in_all_of=False, pointer="#")


def _closed(schema, merged_refs: set[str], in_all_of: bool, pointer: str, beside=None):
    """`beside`: the properties of the schema whose `anyOf`/`oneOf` branch this is, which
    the branch's instances hold too."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            out[key] = _closed(schema[key], merged_refs, False, f"{pointer}/{key}")
    if isinstance(schema.get("items"), list):  # draft 4-7 tuples
        out["items"] = [_closed(s, merged_refs, False, "") for s in schema["items"]]
    adds_up = _adds_up(schema)
    for key in _LIST:
        if isinstance(schema.get(key), list):
            shared = schema.get("properties", {}) if adds_up and key != "prefixItems" else None
            out[key] = [_closed(s, merged_refs, False, "", shared) for s in schema[key]]
    if isinstance(schema.get("allOf"), list):
        out["allOf"] = [_closed(s, merged_refs, True, "") for s in schema["allOf"]]
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            out[key] = {
                name: _closed(sub, merged_refs, False, f"{pointer}/{key}/{name}")
                for name, sub in schema[key].items()
            }
    says_itself = "additionalProperties" in schema or "unevaluatedProperties" in schema
    merged = in_all_of or "allOf" in schema or pointer in merged_refs or adds_up
    if _lists_properties(schema) and not says_itself and not merged:
        listed = {**{name: {} for name in beside or ()}, **out.get("properties", {})}
        for name in schema.get("required") or []:
            if isinstance(name, str):
                listed.setdefault(name, {})
        if listed or "properties" in schema:
            out["properties"] = listed
        out["additionalProperties"] = False
    return out


def _lists_properties(schema: dict) -> bool:
    return "properties" in schema or "patternProperties" in schema


def _adds_up(schema: dict) -> bool:
    """Whether `schema` lists properties that a `$ref` beside it, or `anyOf`/`oneOf`
    branches with properties (or `$ref`s) of their own, add to."""
    if not _lists_properties(schema):
        return False
    branches = [b for key in ("anyOf", "oneOf") for b in schema.get(key) or []]
    return "$ref" in schema or any(
        isinstance(b, dict) and (_lists_properties(b) or "$ref" in b) for b in branches
    )


def _collect_merged_refs(schema, into: set[str]) -> None:
    """The `$ref`s whose definitions are merged with other schemas anywhere in `schema`
    (parts of an `allOf`, a `$ref` beside properties, a `$ref` branch of a schema whose
    properties add up): those definitions stay open."""
    if isinstance(schema, dict):
        parts = list(schema.get("allOf") or [])
        if _adds_up(schema):
            parts += [schema, *schema.get("anyOf", []), *schema.get("oneOf", [])]
        for part in parts:
            if isinstance(part, dict) and isinstance(part.get("$ref"), str):
                into.add(part["$ref"])
        for value in schema.values():
            _collect_merged_refs(value, into)
    elif isinstance(schema, list):
        for value in schema:
            _collect_merged_refs(value, into)
