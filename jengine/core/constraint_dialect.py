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
  word; an object schema without `properties` stays any object; and the parts of an
  `allOf` stay open, since their properties add up.
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


def _closed(schema, merged_refs: set[str], in_all_of: bool, pointer: str):
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            out[key] = _closed(schema[key], merged_refs, False, f"{pointer}/{key}")
    if isinstance(schema.get("items"), list):  # draft 4-7 tuples
        out["items"] = [_closed(s, merged_refs, False, "") for s in schema["items"]]
    for key in _LIST:
        if isinstance(schema.get(key), list):
            out[key] = [_closed(s, merged_refs, False, "") for s in schema[key]]
    if isinstance(schema.get("allOf"), list):
        out["allOf"] = [_closed(s, merged_refs, True, "") for s in schema["allOf"]]
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            out[key] = {
                name: _closed(sub, merged_refs, False, f"{pointer}/{key}/{name}")
                for name, sub in schema[key].items()
            }
    lists_properties = "properties" in schema or "patternProperties" in schema
    says_itself = "additionalProperties" in schema or "unevaluatedProperties" in schema
    merged = in_all_of or "allOf" in schema or pointer in merged_refs
    if lists_properties and not says_itself and not merged:
        out["additionalProperties"] = False
    return out


def _collect_merged_refs(schema, into: set[str]) -> None:
    """The `$ref`s that are parts of an `allOf` anywhere in `schema`: the definitions they
    point at are merged with other parts, so they stay open."""
    if isinstance(schema, dict):
        for part in schema.get("allOf") or []:
            if isinstance(part, dict) and isinstance(part.get("$ref"), str):
                into.add(part["$ref"])
        for value in schema.values():
            _collect_merged_refs(value, into)
    elif isinstance(schema, list):
        for value in schema:
            _collect_merged_refs(value, into)
