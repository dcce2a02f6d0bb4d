"""The `additionalProperties` policy of the `json_schema` processor's `strict` parameter (the default): an object
schema that lists `properties` but does not say `additionalProperties` gets `additionalProperties: false`, so the
model writes only the keys the schema names (JSON Schema's own default, `true`, would let it invent keys). An explicit
`additionalProperties` is kept. The policy only ever narrows the schema: every value it allows, the schema as written
allows. So:
- closing never forbids a key the schema can require: object schemas intersected with others stay open (the parts of
  `allOf`, `then`/`else` and dependent schemas; the parts of an `anyOf`/`oneOf` beside keywords that bring in or
  count keys of the same object, such as `properties`, `required`, `$ref`, `allOf`, another `anyOf`/`oneOf`, `if`,
  dependencies, `unevaluatedProperties`, `minProperties`, or inside such a part; a local `$ref` target used in those
  places or with constraining siblings), and a closed schema keeps the keys its `required` lists and those its
  combined parts name, as any value;
- where narrowing a subschema would widen the whole, the subschema stays as written: `not`, `if`, `contains` beside
  `maxContains`, and the branches of a `oneOf` unless they are provably disjoint as written (different types, or a
  required key whose allowed values differ, or one the other forbids): closing overlapping branches could make
  them look disjoint and let out a value that matches two of them;
- local references are resolved by JSON pointer, `$id` and `$anchor` (and draft 6/7's `"$id": "#name"`); a
  reference that cannot be resolved where its target would have to stay open or as written closes nothing.

It is a policy of the structured-output plugin's `json_schema` processor, applied before the schema becomes a
`ConstraintSpec`: a spec's text is the schema a backend compiles, whatever wrote it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

__all__ = ["forbid_additional_properties"]

# Keys whose value is a schema, a list of schemas, or a map of name -> schema (JSON Schema 2020-12 applicators,
# and draft 4's `dependencies`, whose values may also be lists of names).
_SCHEMA_KEYS = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
                "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
# Keywords whose subschemas are intersected with the schema beside them: they may bring in keys of their own.
_COMBINING = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas", "dependencies")
# Parts always intersected with the schema they sit in (so they stay open).
_PART_KEYS = frozenset(("allOf", "then", "else", "dependentSchemas", "dependencies"))
# Positions where a narrower subschema does not narrow the whole (`not` negates it, `if` picks `then` or `else`,
# and `contains` with `maxContains` caps the matches): left exactly as written.
_AS_WRITTEN_KEYS = frozenset(("not", "if"))
# Keywords beside an `anyOf`/`oneOf` that bring in or count keys of the same object: the parts are then
# intersected with them and stay open.
_OBJECT_SIBLINGS = frozenset(("properties", "required", "patternProperties", "additionalProperties",
                              "unevaluatedProperties", "dependentRequired", "dependentSchemas", "dependencies",
                              "minProperties", "$ref", "$dynamicRef", "$recursiveRef", "allOf", "anyOf", "oneOf",
                              "if", "then", "else", "enum", "const"))
# Keys beside a `$ref` that do not constrain the value (a `$ref` with any other sibling is an intersection).
_ANNOTATIONS = frozenset(("$ref", "description", "title", "$comment", "default", "examples", "$id", "id", "$schema",
                          "deprecated", "readOnly", "writeOnly", "definitions", "$defs", "$anchor", "$dynamicAnchor",
                          "$vocabulary"))
_REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
# Keys that constrain nothing about the value: `allOf: [X]` beside these alone is X itself (a `$ref` beside it lays
# another schema over the same value, so it is not among them).
_NOT_CONSTRAINING = _ANNOTATIONS - frozenset(_REF_KEYS)
# Keywords that lay another schema over the same value: a property's subschema is then intersected with the same
# property's subschema there (`{"$ref": ..., "properties": {"a": ...}}`), so the subschemas of an intersected
# object stay open all the way down (closing one side's `a` would forbid keys the other side's `a` requires).
_INTERSECTING = frozenset(("$ref", "$dynamicRef", "$recursiveRef", "allOf", "anyOf", "oneOf", "then", "else",
                           "dependentSchemas", "dependencies"))
_DEFINITIONS = frozenset(("$defs", "definitions"))
_TYPE_NAMES = {"null": ("null",), "boolean": ("boolean",), "object": ("object",), "array": ("array",),
               "string": ("string",), "integer": ("integer",), "number": ("number", "integer")}
_ALL_TYPES = frozenset(("null", "boolean", "object", "array", "string", "number", "integer"))  # number: non-integer
_MAX_DEPTH = 8  # how deep the disjointness proof follows references and properties
_MAX_BRANCHES = 64  # a `oneOf` with more branches is not checked pair by pair (it stays as written)
_Pointer = tuple[str, ...]


def _children(schema: dict[str, Any]) -> Iterator[tuple[_Pointer, Any]]:
    """Each subschema position of `schema` (dicts and booleans) with its relative path."""
    for key, value in schema.items():
        if key in _SCHEMA_KEYS and isinstance(value, dict | bool):
            yield (key,), value
        elif key in _SCHEMA_LIST_KEYS and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict | bool):
                    yield (key, str(i)), item
        elif key in _SCHEMA_MAP_KEYS and isinstance(value, dict):
            for name, item in value.items():
                if isinstance(item, dict | bool):
                    yield (key, name), item


def _resolve(root: Any, path: _Pointer) -> Any:
    node = root
    for part in path:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _value_key(value: Any) -> tuple[str, Any] | None:
    """A hashable key equal for JSON values JSON Schema calls equal (scalars only; None for others)."""
    if value is None:
        return ("null", None)
    if isinstance(value, bool):
        return ("boolean", value)
    if isinstance(value, int | float):
        return ("number", value)  # 1 == 1.0, as in JSON Schema
    if isinstance(value, str):
        return ("string", value)
    return None


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


class _Policy:
    """The `additionalProperties` policy over one schema document: where each subschema stands (open: intersected
    with schemas beside it; as written: a narrower version could let in values the schema refuses), the local
    references resolved (JSON pointers, `$id`s and `$anchor`s), and the closed copy."""

    def __init__(self, root: dict[str, Any], root_open: bool) -> None:
        self.root = root
        draft = root.get("$schema")
        self.legacy_id = isinstance(draft, str) and ("draft-03" in draft or "draft-04" in draft)
        self.bases: dict[_Pointer, str] = {}
        self.resources: dict[str, _Pointer] = {}
        self.anchors: dict[str, _Pointer] = {}
        self.unsafe = False  # an unresolved reference must stay open or as written: close nothing
        self._disjoint: dict[_Pointer, bool] = {}
        self._index()
        self.flags: dict[_Pointer, tuple[bool, bool]] = {}  # path -> (open, as written)
        self._mark(root_open)

    # ---- references ----------------------------------------------------------------------------------------
    def _index(self) -> None:
        stack: list[tuple[_Pointer, Any, str]] = [((), self.root, "")]
        while stack:
            path, node, base = stack.pop()
            if not isinstance(node, dict):
                continue
            ident = node.get("$id")
            if ident is None and self.legacy_id:
                ident = node.get("id")
            if isinstance(ident, str):
                full = self._join(base, ident)
                uri, _, fragment = full.partition("#")
                if urldefrag(ident).url or not path:
                    base = uri
                    self.resources.setdefault(uri, path)
                if fragment and not fragment.startswith("/"):
                    self.anchors.setdefault(f"{uri}#{fragment}", path)  # `"$id": "#name"` (drafts 6 and 7)
            if not path:
                self.resources.setdefault(base, ())
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(node.get(key), str):
                    self.anchors.setdefault(f"{base}#{node[key]}", path)
            self.bases[path] = base
            stack.extend((path + sub, child, base) for sub, child in _children(node))

    @staticmethod
    def _join(base: str, ref: str) -> str:
        if ref.startswith("#"):
            return urldefrag(base).url + ref
        try:
            return urljoin(base, ref)
        except ValueError:
            return ref

    def resolve(self, path: _Pointer, ref: str) -> _Pointer | None:
        """The path of the schema `ref` (written at `path`) names inside this document, or None."""
        uri, _, fragment = self._join(self.bases.get(path, ""), ref).partition("#")
        if not fragment or fragment.startswith("/"):
            start = self.resources.get(uri)
            if start is None:
                return None
            target = start + tuple(unquote(part).replace("~1", "/").replace("~0", "~")
                                   for part in fragment.split("/")[1:])
        else:
            found = self.anchors.get(f"{uri}#{unquote(fragment)}")
            if found is None:
                return None
            target = found
        return target if isinstance(_resolve(self.root, target), dict | bool) else None

    def _ref_target(self, path: _Pointer, node: dict[str, Any]) -> tuple[bool, _Pointer | None]:
        """Whether `node` has a reference, and its target (None when it cannot be resolved; dynamic references
        are never resolved here)."""
        if isinstance(node.get("$ref"), str):
            return True, self.resolve(path, node["$ref"])
        return any(isinstance(node.get(key), str) for key in _REF_KEYS[1:]), None

    # ---- where each subschema stands ----------------------------------------------------------------------------
    def _positions(self, path: _Pointer, node: dict[str, Any], is_open: bool,
                   as_written: bool) -> Iterator[tuple[_Pointer, Any, bool, bool]]:
        """Each child position: its relative path, the child, whether it stays open and whether it stays as
        written."""
        overlaid = bool(set(node) & _INTERSECTING)
        # the property names the schemas laid over this object constrain (None: any name, or not known)
        names = self._overlaid_names(path, node) if overlaid and not is_open else set()
        for sub, child in _children(node):
            key = sub[0]
            if key in _DEFINITIONS:
                child_open = False  # definitions take their flags from their uses
            elif is_open:
                child_open = True  # intersected from above: the other side's subschemas are not known here
            elif key == "properties":
                child_open = names is None or sub[1] in names
            else:
                child_open = overlaid and key not in _INTERSECTING and key not in _AS_WRITTEN_KEYS
            child_as_written = as_written or key in _AS_WRITTEN_KEYS or (key == "contains" and "maxContains" in node)
            if key == "allOf" and len(node["allOf"]) == 1 and not set(node) - _NOT_CONSTRAINING - {"allOf"}:
                child_open = is_open  # `allOf: [X]` with nothing else is X itself (pydantic writes fields so)
            elif key in _PART_KEYS:
                child_open = True
            elif key in ("anyOf", "oneOf"):
                child_open = is_open or bool((set(node) - {key}) & _OBJECT_SIBLINGS)
                if key == "oneOf" and not child_as_written:
                    child_as_written = not self._disjoint_one_of(path, node)
            yield sub, child, child_open, child_as_written

    def _overlaid_names(self, path: _Pointer, node: dict[str, Any]) -> set[str] | None:
        """The property names that the schemas laid over `node` (its `$ref` target, `allOf`/`anyOf`/`oneOf` parts,
        `then`/`else`, dependent schemas, and theirs in turn) give subschemas of their own; None when they may
        constrain any name (`patternProperties`, an `additionalProperties` schema, a reference not resolved here, or
        deeper than `_MAX_DEPTH`)."""
        names: set[str] = set()
        todo: list[tuple[_Pointer, Any, int]] = []

        def overlays(at: _Pointer, schema: dict[str, Any], depth: int) -> bool:
            has_ref, target = self._ref_target(at, schema)
            if has_ref:
                if target is None:
                    return False
                todo.append((target, _resolve(self.root, target), depth + 1))
            for sub, child in _children(schema):
                if sub[0] in _INTERSECTING:
                    todo.append((at + sub, child, depth + 1))
            return True

        if not overlays(path, node, 0):
            return None
        seen: set[_Pointer] = set()
        while todo:
            at, schema, depth = todo.pop()
            if at in seen or not isinstance(schema, dict):
                continue
            seen.add(at)
            if depth > _MAX_DEPTH or "patternProperties" in schema or isinstance(schema.get("additionalProperties"),
                                                                                 dict):
                return None
            if isinstance(schema.get("properties"), dict):
                names.update(schema["properties"])
            if not overlays(at, schema, depth):
                return None
        return names

    def _mark(self, root_open: bool) -> None:
        """Set `flags` for every subschema reached from the root, through its children and local references: a
        reference target takes the flags of the places that use it (open where the reference is intersected with
        other schemas, as written where the reference is)."""
        todo: list[tuple[_Pointer, Any, bool, bool]] = [((), self.root, root_open, False)]
        while todo:
            path, node, is_open, as_written = todo.pop()
            old = self.flags.get(path)
            if old is not None:
                is_open, as_written = is_open or old[0], as_written or old[1]
                if (is_open, as_written) == old:
                    continue
            self.flags[path] = (is_open, as_written)
            if not isinstance(node, dict):
                continue
            has_ref, target = self._ref_target(path, node)
            if has_ref:
                ref_open = is_open or bool(set(node) - _ANNOTATIONS)
                if target is not None:
                    todo.append((target, _resolve(self.root, target), ref_open, as_written))
                elif ref_open or as_written:
                    self.unsafe = True
            todo.extend((path + sub, child, child_open, child_as_written)
                        for sub, child, child_open, child_as_written in self._positions(path, node, is_open,
                                                                                         as_written))

    # ---- `oneOf` branches that no value can match together ----------------------------------------------------
    def _disjoint_one_of(self, path: _Pointer, node: dict[str, Any]) -> bool:
        """Whether no value matches two branches of `node`'s `oneOf` as written: then narrowing the branches
        cannot make a value match two of them, or match one it does not match as written."""
        if path not in self._disjoint:
            branches = [((*path, "oneOf", str(i)), part) for i, part in enumerate(node["oneOf"])]
            self._disjoint[path] = len(branches) <= _MAX_BRANCHES and all(
                self.disjoint(*branches[i], *branches[j], 0)
                for i in range(len(branches)) for j in range(i + 1, len(branches)))
        return self._disjoint[path]

    def _follow(self, path: _Pointer, node: Any) -> tuple[_Pointer, Any] | None:
        """`node`, or the target of its `$ref` (its siblings are left out: drafts 4 to 7 ignore them, later drafts
        intersect them, so the target alone over-approximates it either way); None when unresolvable."""
        for _ in range(_MAX_DEPTH):
            if not isinstance(node, dict):
                return path, node
            has_ref, target = self._ref_target(path, node)
            if not has_ref:
                return path, node
            if target is None:
                return None
            path, node = target, _resolve(self.root, target)
        return None

    def types(self, path: _Pointer, node: Any, depth: int) -> frozenset[str]:
        """The JSON types a value of `node` may have (an over-approximation)."""
        followed = self._follow(path, node) if depth <= _MAX_DEPTH else None
        if followed is None:
            return _ALL_TYPES
        path, node = followed
        if node is False:
            return frozenset()
        if not isinstance(node, dict):
            return _ALL_TYPES
        types = _ALL_TYPES
        written = [node["type"]] if isinstance(node.get("type"), str) else node.get("type")
        if isinstance(written, list) and all(t in _TYPE_NAMES for t in written):
            types = frozenset(name for t in written for name in _TYPE_NAMES[t])
        if "const" in node:
            types &= {_type_of(node["const"])}
        elif isinstance(node.get("enum"), list):
            types &= {_type_of(value) for value in node["enum"]}
        for key in ("allOf", "anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                parts = [self.types((*path, key, str(i)), part, depth + 1) for i, part in enumerate(node[key])]
                if key == "allOf":
                    for part_types in parts:
                        types &= part_types
                else:
                    types &= frozenset().union(*parts)
        return types

    @staticmethod
    def _values(node: dict[str, Any]) -> set[tuple[str, Any]] | None:
        """The values `node` allows, when `const` or `enum` lists them all and they are scalars."""
        values = [node["const"]] if "const" in node else node.get("enum")
        if not isinstance(values, list):
            return None
        keys = [_value_key(value) for value in values]
        return {key for key in keys if key is not None} if None not in keys else None

    def disjoint(self, path_a: _Pointer, a: Any, path_b: _Pointer, b: Any, depth: int) -> bool:
        """Whether no value matches both `a` and `b` as written (False when it cannot tell)."""
        if depth > _MAX_DEPTH:
            return False
        followed_a, followed_b = self._follow(path_a, a), self._follow(path_b, b)
        if followed_a is None or followed_b is None:
            return False
        (path_a, a), (path_b, b) = followed_a, followed_b
        if a is False or b is False:
            return True
        if not isinstance(a, dict) or not isinstance(b, dict):
            return False
        common = self.types(path_a, a, depth) & self.types(path_b, b, depth)
        if not common:
            return True
        values_a, values_b = self._values(a), self._values(b)
        if values_a is not None and values_b is not None and not values_a & values_b:
            return True
        if common != {"object"}:
            return False
        for (path_x, x), (path_y, y) in (((path_a, a), (path_b, b)), ((path_b, b), (path_a, a))):
            required: list[Any] = x["required"] if isinstance(x.get("required"), list) else []
            props_x: dict[str, Any] = x["properties"] if isinstance(x.get("properties"), dict) else {}
            props_y: dict[str, Any] = y["properties"] if isinstance(y.get("properties"), dict) else {}
            for name in required:
                if not isinstance(name, str):
                    continue
                if name not in props_y and y.get("additionalProperties") is False and "patternProperties" not in y:
                    return True  # x requires a key y forbids
                if name in props_x and name in props_y and self.disjoint(
                        (*path_x, "properties", name), props_x[name], (*path_y, "properties", name), props_y[name],
                        depth + 1):
                    return True  # x requires a key whose values in x and in y differ
        return False

    # ---- the closed copy -------------------------------------------------------------------------------------------
    def named_keys(self, path: _Pointer, schema: dict[str, Any], seen: set[int]) -> list[str]:
        """The property names an object schema and the schemas combined with it (`allOf`, `anyOf`, `oneOf`, `$ref`,
        `if`/`then`/`else`, dependencies) list or require."""
        if id(schema) in seen:
            return []
        seen.add(id(schema))
        names: list[str] = []
        for key in ("properties", "dependentSchemas", "dependentRequired", "dependencies"):
            if isinstance(schema.get(key), dict):
                names += schema[key]
                for name, value in schema[key].items():
                    if key != "properties" and isinstance(value, list):
                        names += [v for v in value if isinstance(v, str)]
                    elif key != "properties" and isinstance(value, dict):
                        names += self.named_keys((*path, key, name), value, seen)
        if isinstance(schema.get("required"), list):
            names += [name for name in schema["required"] if isinstance(name, str)]
        parts = [((*path, key, str(i)), part) for key in ("allOf", "anyOf", "oneOf")
                 if isinstance(schema.get(key), list) for i, part in enumerate(schema[key])]
        parts += [((*path, key), schema.get(key)) for key in ("if", "then", "else")]
        _, target = self._ref_target(path, schema)
        if target is not None:
            parts.append((target, _resolve(self.root, target)))
        for part_path, part in parts:
            if isinstance(part, dict):
                names += self.named_keys(part_path, part, seen)
        return names

    def close(self, schema: dict[str, Any], path: _Pointer) -> dict[str, Any]:
        out = dict(schema)
        copied: set[str] = set()
        for sub, child in _children(schema):
            if not isinstance(child, dict):
                continue
            closed = self.close(child, path + sub)
            if len(sub) == 1:
                out[sub[0]] = closed
                continue
            key, index = sub
            if key not in copied:  # copy a list or map the first time one of its items changes
                out[key] = list(out[key]) if isinstance(out[key], list) else dict(out[key])
                copied.add(key)
            if isinstance(out[key], list):
                out[key][int(index)] = closed
            else:
                out[key][index] = closed
        if out.get("uniqueItems") is False:
            del out["uniqueItems"]  # asks for nothing; a backend that cannot enforce `uniqueItems: true` must not
            # refuse it
        is_open, as_written = self.flags.get(path, (True, True))
        if (isinstance(out.get("properties"), dict) and "additionalProperties" not in out
                and "unevaluatedProperties" not in out and "patternProperties" not in out
                and not is_open and not as_written and not self.unsafe):
            out["additionalProperties"] = False
            # keys the schema requires, or that schemas combined with it name, stay allowed (as any value)
            named = self.named_keys(path, schema, set()) if any(key in out for key in _COMBINING) else []
            if isinstance(out.get("required"), list):
                named += [name for name in out["required"] if isinstance(name, str)]
            missing = [name for name in dict.fromkeys(named) if name not in out["properties"]]
            if missing:
                out["properties"] = {**out["properties"], **{name: {} for name in missing}}
        return out


def forbid_additional_properties(schema: dict[str, Any], _in_all_of: bool = False) -> dict[str, Any]:
    """A copy of `schema` where object schemas listing `properties` without `additionalProperties` forbid extra
    keys (see the module docstring for the policy), and the no-op `uniqueItems: false` is dropped. Only schema
    positions are visited, so a property named `properties` is a name, not a keyword. Every value the copy allows,
    the schema as written allows."""
    return _Policy(schema, _in_all_of).close(schema, ())
