"""Generate `subagent/acp/schema.py` (msgspec wire types) from the vendored ACP JSON Schema.

Usage: `python scripts/gen_schema.py` rewrites the module; `--check` exits 1 when the committed
module differs from what would be generated (CI and `tests/test_schema.py` run it that way).

`subagent/acp/schema.py` comes from the stable `schema/acp/v1/schema.json`, plus `source.json`
beside it (where the file came from: package, version, sha256, protocol version). The method table
comes from the schema's `x-method` / `x-side` annotations.

`subagent/acp/schema_unstable.py` comes from `schema.unstable.json`, but only the definitions that
`UNSTABLE_DEFINITIONS` lists by name (the subagents draft: `subagent_update`, its state snapshots,
the per-child capabilities, `session_message`, and the client capabilities that advertise them),
with the variants and fallbacks of the unions among them. Every other definition they use is
imported from the stable module, and must be there with the same shape (descriptions aside): the
generator stops naming it otherwise, and it then belongs in the list. The whole unstable file is
not generated because its method table cannot be: `mcp/message` is both a request and a
notification, and the `proxy` side is neither an agent's nor a client's; nor is it needed, as the
unstable variants of `SessionUpdate` arrive as `UnknownSessionUpdate` with their `raw` object, which
`convert` turns into the unstable type. The output is deterministic: definitions are emitted in schema
order, moved only as far as needed so that every name is defined before it is used (the generated
module evaluates its annotations eagerly, which msgspec needs anyway), and the result is piped
through `ruff format`.

How JSON Schema maps onto msgspec (the reasoning lives here, the generated module only states it):

* object definitions become frozen, keyword-only `WireStruct`s (camelCase on the wire, snake_case
  in Python, `_meta` as `meta`), with defaults from the schema or None;
* string-constant enums become `Literal[...]` aliases (`| str` when the schema has an open "other");
* discriminated unions become unions of tagged structs plus an `Unknown*` fallback member. A
  variant without a wire tag (stdio MCP servers, `agent` auth methods, ...) and the fallback get an
  internal tag that starts with NUL: the codec in `subagent/acp/_wire.py`, which the generated
  module imports and re-exports, inserts it when decoding and strips it when encoding, so it never
  reaches the wire;
* untagged anyOf groups that only add alternative fields (the elicitation scopes) are flattened
  into optional fields, and untagged unions of structs get internal tags the same way;
* `x-deserialize-default-on-error`, `x-deserialize-skip-invalid-items` and
  `x-deserialize-default-on-null` become a table that the tolerant decoder applies, and `x-method`
  / `x-side` become the method table.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import keyword
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

__all__ = ["generate", "main"]

ROOT: Final = Path(__file__).resolve().parents[1]
SCHEMA_DIR: Final = ROOT / "schema" / "acp" / "v1"
OUTPUT: Final = ROOT / "subagent" / "acp" / "schema.py"
UNSTABLE_OUTPUT: Final = ROOT / "subagent" / "acp" / "schema_unstable.py"

# The definitions `schema_unstable.py` holds, generated from `schema.unstable.json` (see the docstring).
UNSTABLE_DEFINITIONS: Final = (
    "SubagentCapabilities",
    "PlanCapabilities",
    "ClientCapabilities",
    "InitializeRequest",
    "SubagentSessionCapabilities",
    "SessionCancelCapabilities",
    "Usage",
    "StateUpdate",
    "SubagentUpdate",
    "SessionMessage",
    "SessionMessageChunk",
)

Schema = dict[str, Any]

# Internal tags start with NUL: msgspec escapes it as \u0000, so the encoder can spot them cheaply.
# `subagent/acp/_wire.py` (the codec) relies on the same prefix.
SENTINEL: Final = "\x00"
UNKNOWN_TAG: Final = SENTINEL + "unknown"
# Tag field of unions that have no discriminator at all on the wire.
UNTAGGED_FIELD: Final = SENTINEL + "variant"

# Class names for union variants whose natural name is taken or unhelpful. The default for an
# inline variant is `<Union><Tag>`, and for a shared definition `<Tag>` (ContentChunk gives
# UserMessageChunk, AgentMessageChunk, AgentThoughtChunk).
VARIANT_NAMES: Final[dict[tuple[str, str], str]] = {
    # `ToolCallUpdate` is also the permission request's tool call, which carries no tag.
    ("SessionUpdate", "tool_call_update"): "ToolCallProgress",
    # Siblings of SelectedPermissionOutcome and ElicitationAcceptAction.
    ("RequestPermissionOutcome", "cancelled"): "CancelledPermissionOutcome",
    ("CreateElicitationResponse", "decline"): "ElicitationDeclineAction",
    ("CreateElicitationResponse", "cancel"): "ElicitationCancelAction",
}

# Fallback members whose natural name (`Unknown<Union>`) is a variant of the union itself: StateUpdate
# has a state called "unknown", defined as UnknownStateUpdate; its schema titles the fallback "other".
FALLBACK_NAMES: Final[dict[str, str]] = {"StateUpdate": "OtherStateUpdate"}

# Unions whose schema says that an unknown tag decodes as the untagged variant, so they get no
# fallback member. SetSessionConfigOptionRequest, `value_id`: "Unknown `type` values with string
# payloads also gracefully deserialize into this variant."
UNKNOWN_TAG_IS_DEFAULT: Final = frozenset({"SetSessionConfigOptionRequest"})

# The `x-side` values and the tables they fill: who handles the method.
METHOD_SIDES: Final = ("agent", "client", "protocol")

HEADER_NOTE: Final = "# Generated by scripts/gen_schema.py from schema/acp/v1/{file}: do not edit."


# --------------------------------------------------------------------------------------------
# Intermediate representation


@dataclass
class TypeExpr:
    """A Python type expression, the generated names it uses, and whether it admits None."""

    src: str
    deps: list[str]
    nullable: bool = False


@dataclass
class FieldDef:
    """One struct field."""

    attr: str
    wire: str
    type: TypeExpr
    default: str | None  # Python source; None means required
    default_json: Any
    has_json_default: bool
    doc: str
    default_on_error: bool
    skip_invalid_items: bool
    default_on_null: bool


@dataclass
class ClassDef:
    """One generated struct class."""

    name: str
    doc: str
    fields: list[FieldDef]
    base: str = "WireStruct"
    tag_field: str | None = None
    tag: str | None = None
    inherited: list[FieldDef] = field(default_factory=list)

    @property
    def all_fields(self) -> list[FieldDef]:
        return self.inherited + self.fields

    def deps(self) -> list[str]:
        names = [] if self.base in ("WireStruct", "UnknownVariant") else [self.base]
        for f in self.fields:
            names += f.type.deps
            if f.default is not None:
                names += re.findall(r"\b([A-Z]\w*)\(", f.default)
        return names


@dataclass
class AliasDef:
    """One generated type alias."""

    name: str
    type: TypeExpr
    doc: str

    def deps(self) -> list[str]:
        return self.type.deps


@dataclass
class UnionDef:
    """A tagged union: its members, optional fallback, and its alias."""

    name: str
    doc: str
    tag_field: str
    members: list[str]
    fallback: str | None


# --------------------------------------------------------------------------------------------
# Small helpers


def first_paragraph(text: str | None) -> str:
    """The first paragraph of a schema description, which is what an IDE tooltip needs."""
    if not text:
        return ""
    paragraphs = [p.strip() for p in text.strip().split("\n\n")]
    # The unstable schema opens with the same warning everywhere: the paragraph after it says what it is.
    while len(paragraphs) > 1 and (
        paragraphs[0] == "**UNSTABLE**"
        or paragraphs[0].startswith("This capability is not part of the spec yet")
    ):
        paragraphs.pop(0)
    return paragraphs[0]


def to_snake(name: str) -> str:
    """`mimeType` -> `mime_type`; `_meta` -> `meta`; keywords get a trailing underscore."""
    snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name.lstrip("_")).lower()
    return snake + "_" if keyword.iskeyword(snake) else snake


def to_camel(attr: str) -> str:
    """msgspec's `rename="camel"`: `mime_type` -> `mimeType` (leading underscores kept)."""
    stripped = attr.lstrip("_")
    prefix = attr[: len(attr) - len(stripped)]
    head, *rest = stripped.split("_")
    return prefix + head + "".join(part[:1].upper() + part[1:] for part in rest)


def pascal(tag: str) -> str:
    """`agent_message_chunk` -> `AgentMessageChunk`."""
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[_\-\s]+", tag) if part)


def ref_name(schema: Schema) -> str | None:
    """The definition a schema points to, directly or through a one-element allOf."""
    if "$ref" in schema:
        ref: str = schema["$ref"]
        return ref.rsplit("/", 1)[1]
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) == 1 and "properties" not in schema:
        return ref_name(all_of[0])
    return None


def docstring(text: str, indent: str) -> str:
    """A triple-quoted docstring literal for `text` (already reduced to what should show)."""
    body = text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    if body.endswith('"'):
        body += " "
    lines = body.split("\n")
    if len(lines) == 1:
        return f'{indent}"""{body}"""\n'
    inner = "\n".join((indent + line).rstrip() for line in lines[1:])
    return f'{indent}"""{lines[0]}\n{inner}\n{indent}"""\n'


def py_literal(value: Any) -> str:
    """Python source for a JSON scalar."""
    if value is None or isinstance(value, bool | int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise TypeError(f"not a scalar: {value!r}")


def union_src(members: list[str], nullable: bool) -> str:
    parts = list(dict.fromkeys(members))
    if nullable:
        parts.append("None")
    return " | ".join(parts)


def variant_props(variant: Schema) -> dict[str, Schema]:
    props: dict[str, Schema] = variant.get("properties", {})
    return props


def find_tag_field(variants: list[Schema]) -> str | None:
    """The property that carries a `const` in the variants of a union, if there is one."""
    names = {name for v in variants for name, p in variant_props(v).items() if "const" in p}
    if not names:
        return None
    if len(names) > 1:
        raise SystemExit(f"ambiguous discriminator {sorted(names)}")
    return names.pop()


# --------------------------------------------------------------------------------------------
# The generator


class Generator:
    """Turns the schema's `$defs` into class, alias and union definitions, then into source."""

    def __init__(self, schema: Schema) -> None:
        self.defs: dict[str, Schema] = {
            name: d for name, d in schema["$defs"].items() if not d.get("x-docs-ignore")
        }
        self.classes: dict[str, ClassDef] = {}
        self.aliases: dict[str, AliasDef] = {}
        self.unions: dict[str, UnionDef] = {}
        self.constants: list[tuple[str, str, str]] = []  # (name, source, comment)
        self.order: list[str] = []  # definition order before the dependency sort
        self.ref_counts = self._count_refs()
        self.absorbed: set[str] = set()  # definitions emitted as union variants

    # -- analysis ------------------------------------------------------------------------

    def _count_refs(self) -> dict[str, int]:
        counts: dict[str, int] = dict.fromkeys(self.defs, 0)

        def walk(node: Any) -> None:
            if isinstance(node, dict):
                if "$ref" in node:
                    name = node["$ref"].rsplit("/", 1)[1]
                    counts[name] = counts.get(name, 0) + 1
                for value in node.values():
                    walk(value)
            elif isinstance(node, list):
                for value in node:
                    walk(value)

        walk(self.defs)
        return counts

    def union_variants(self, d: Schema) -> list[Schema] | None:
        variants = d.get("oneOf") or d.get("anyOf")
        return variants if isinstance(variants, list) else None

    def is_tagged_union(self, d: Schema) -> bool:
        variants = self.union_variants(d)
        if not variants:
            return False
        tag_field = find_tag_field(variants)
        # An object that declares the discriminator as a property of its own (IdleStateUpdate's
        # `stopReason`) is one struct: its variants only refine that property, and are flattened.
        return tag_field is not None and tag_field not in d.get("properties", {})

    def is_struct_union(self, d: Schema) -> bool:
        """An anyOf of objects without a discriminator (TextResourceContents | Blob...)."""
        variants = self.union_variants(d)
        if not variants or "properties" in d or len(variants) < 2:
            return False
        targets = [ref_name(v) for v in variants]
        return all(target is not None and self.is_object(target) for target in targets)

    def is_object(self, name: str) -> bool:
        d = self.defs[name]
        return d.get("type") == "object" and not self.is_tagged_union(d)

    # -- types ---------------------------------------------------------------------------

    def type_of(self, s: Schema) -> TypeExpr:
        """The Python annotation for a property schema."""
        name = ref_name(s)
        if name is not None:
            nullable = self.def_nullable(name)
            return TypeExpr(name, [name], nullable)
        variants = s.get("anyOf") or s.get("oneOf")
        if variants:
            members = [self.type_of(v) for v in variants if v.get("type") != "null"]
            nullable = any(v.get("type") == "null" for v in variants) or any(m.nullable for m in members)
            srcs = [m.src for m in members if m.src != "None"]
            member_deps = [dep for m in members for dep in m.deps]
            return TypeExpr(union_src(srcs, nullable), member_deps, nullable)
        if "const" in s:
            return TypeExpr(f"Literal[{py_literal(s['const'])}]", [])
        raw_type = s.get("type")
        types = raw_type if isinstance(raw_type, list) else [raw_type] if raw_type else []
        nullable = "null" in types
        types = [t for t in types if t != "null"]
        if not types:
            return TypeExpr("None" if nullable else "Any", [], nullable)
        if len(types) > 1:
            raise SystemExit(f"multi-typed property not supported: {s}")
        kind = types[0]
        deps: list[str] = []
        if kind == "string":
            src = "str"
        elif kind == "integer":
            src = "int"
        elif kind == "number":
            src = "float"
        elif kind == "boolean":
            src = "bool"
        elif kind == "array":
            item = self.type_of(s.get("items", {}))
            src, deps = f"list[{item.src}]", item.deps
        elif kind == "object":
            extra = s.get("additionalProperties", True)
            if isinstance(extra, dict):
                value = self.type_of(extra)
                src, deps = f"dict[str, {value.src}]", value.deps
            else:
                src = "dict[str, Any]"
        else:
            raise SystemExit(f"unsupported type {kind!r}")
        return TypeExpr(union_src([src], nullable), deps, nullable)

    def def_nullable(self, name: str) -> bool:
        variants = self.union_variants(self.defs[name]) or []
        return any(v.get("type") == "null" for v in variants)

    # -- objects -------------------------------------------------------------------------

    def alternatives(self, s: Schema) -> list[list[tuple[str, Schema, bool]]]:
        """Each way an object can look: (property, schema, required) after allOf/anyOf."""
        name = ref_name(s) if "$ref" in s else None
        if name is not None:
            s = self.defs[name]
        required = set(s.get("required", []))
        own = [(prop, ps, prop in required) for prop, ps in s.get("properties", {}).items()]
        result = [own]
        for sub in s.get("allOf", []):
            result = [a + b for a in result for b in self.alternatives(sub)]
        variants = self.union_variants(s)
        if variants:
            result = [a + b for a in result for v in variants for b in self.alternatives(v)]
        return result

    def declared(self, s: Schema) -> tuple[set[str], set[str]]:
        """The properties an object declares itself (directly or through allOf, not in its anyOf
        alternatives), and those of them it requires."""
        name = ref_name(s) if "$ref" in s else None
        if name is not None:
            s = self.defs[name]
        props, required = set(s.get("properties", {})), set(s.get("required", []))
        for sub in s.get("allOf", []):
            more, more_required = self.declared(sub)
            props |= more
            required |= more_required
        return props, required

    def fields_of(self, s: Schema, *, skip: frozenset[str] = frozenset()) -> list[FieldDef]:
        """Struct fields for an object schema; untagged anyOf alternatives become optional."""
        alts = self.alternatives(s)
        declared, own_required = self.declared(s)
        merged: dict[str, list[tuple[Schema, bool]]] = {}
        for alt in alts:
            seen: dict[str, tuple[Schema, bool]] = {}
            for prop, ps, req in alt:
                if prop in seen:
                    old, old_req = seen[prop]
                    # A variant may restate a property with a const: keep the richer schema.
                    seen[prop] = (ps if len(ps) > len(old) else old, old_req or req)
                else:
                    seen[prop] = (ps, req)
            for prop, entry in seen.items():
                merged.setdefault(prop, []).append(entry)
        fields = []
        for prop, entries in merged.items():
            if prop in skip:
                continue
            in_all = len(entries) == len(alts)
            required = in_all and all(req for _, req in entries)
            required_somewhere = any(req for _, req in entries)
            schemas = [ps for ps, _ in entries]
            # A property the object declares itself keeps its own optionality: variants that require
            # it only say which values it may take (IdleStateUpdate's `stopReason`).
            flattened = required_somewhere and not (prop in declared and prop not in own_required)
            fields.append(self.make_field(prop, schemas, required, flattened=flattened))
        # `_meta` last: it is on every type and says the least.
        fields.sort(key=lambda f: f.wire == "_meta")
        return fields

    def make_field(self, prop: str, schemas: list[Schema], required: bool, flattened: bool) -> FieldDef:
        distinct: dict[str, Schema] = {}
        for ps in schemas:
            key = json.dumps({k: v for k, v in ps.items() if k != "description"}, sort_keys=True)
            distinct.setdefault(key, ps)
        variants = list(distinct.values())
        if len(variants) == 1:
            texpr = self.type_of(variants[0])
        elif all("const" in v for v in variants) and len(variants) == len(schemas):
            consts = ", ".join(py_literal(v["const"]) for v in variants)
            texpr = TypeExpr(f"Literal[{consts}]", [])
        elif all("const" in v or v.get("type") == "string" for v in variants):
            texpr = TypeExpr("str", [])
        else:
            parts = [self.type_of(v) for v in variants]
            nullable = any(p.nullable for p in parts)
            srcs = [p.src.removesuffix(" | None") for p in parts]
            texpr = TypeExpr(union_src(srcs, nullable), [d for p in parts for d in p.deps], nullable)
        ps0 = schemas[0]
        doc = first_paragraph(next((ps["description"] for ps in schemas if ps.get("description")), None))
        attr = "meta" if prop == "_meta" else to_snake(prop)
        default: str | None = None
        default_json: Any = None
        has_json_default = "default" in ps0
        if not required:
            if has_json_default:
                default_json = ps0["default"]
                default = self.default_src(default_json, texpr)
            elif texpr.nullable and flattened:
                # Required in some alternative where null is a real value (a JSON-RPC id can be
                # null), so "absent" needs its own marker.
                texpr = TypeExpr(texpr.src + " | msgspec.UnsetType", texpr.deps, True)
                default = "msgspec.UNSET"
            else:
                if not texpr.nullable and texpr.src != "Any":
                    texpr = TypeExpr(texpr.src + " | None", texpr.deps, True)
                default = "None"
        return FieldDef(
            attr=attr,
            wire=prop,
            type=texpr,
            default=default,
            default_json=default_json,
            has_json_default=has_json_default,
            doc=doc,
            default_on_error=any(ps.get("x-deserialize-default-on-error") for ps in schemas),
            skip_invalid_items=any(ps.get("x-deserialize-skip-invalid-items") for ps in schemas),
            default_on_null=any(ps.get("x-deserialize-default-on-null") for ps in schemas),
        )

    def default_src(self, value: Any, texpr: TypeExpr) -> str:
        """Python source for a schema default; object defaults become shared frozen instances."""
        if isinstance(value, list):
            if value:
                raise SystemExit(f"non-empty list default {value!r}")
            return "[]"
        if isinstance(value, dict):
            if texpr.src.startswith("dict["):
                if value:
                    raise SystemExit(f"non-empty dict default {value!r}")
                return "{}"
            return self.instance_src(texpr.src, value)
        return py_literal(value)

    def instance_src(self, class_name: str, value: Schema) -> str:
        cls = self.classes[class_name]
        # One frozen instance is shared by every struct that defaults to it, so it must not hold
        # mutable containers.
        if any(f.default in ("[]", "{}") for f in cls.all_fields):
            raise SystemExit(f"{class_name} has a mutable default and cannot be a shared default")
        by_wire = {f.wire: f for f in cls.all_fields}
        args = []
        for key, item in value.items():
            f = by_wire[key]
            if not self.is_default(f, item):
                args.append(f"{f.attr}={self.default_src(item, f.type)}")
        return f"{class_name}({', '.join(args)})"

    def is_default(self, f: FieldDef, value: Any) -> bool:
        if f.has_json_default and f.default_json == value:
            return True
        if isinstance(value, dict) and f.type.src in self.classes:
            cls = self.classes[f.type.src]
            by_wire = {g.wire: g for g in cls.all_fields}
            return f.has_json_default and all(self.is_default(by_wire[k], v) for k, v in value.items())
        return False

    # -- building ------------------------------------------------------------------------

    def build(self) -> None:
        # Unions first: they decide which definitions become tagged variants.
        for d in self.defs.values():
            if self.is_tagged_union(d):
                for v in self.union_variants(d) or []:
                    target = self.variant_ref(v)
                    if target and self.ref_counts[target] == 1 and self.is_object(target):
                        self.absorbed.add(target)
        # Plain objects in dependency-free order; defaults may need other classes, so retry.
        pending = [
            n
            for n, d in self.defs.items()
            if d.get("type") == "object" and not self.is_tagged_union(d) and n not in self.absorbed
        ]
        for name in self.sorted_for_defaults(pending):
            d = self.defs[name]
            self.classes[name] = ClassDef(name, first_paragraph(d.get("description")), self.fields_of(d))
        for name, d in self.defs.items():
            self.order.append(name)
            if name in self.classes or name in self.absorbed:
                continue
            if self.is_tagged_union(d):
                self.build_tagged_union(name, d)
            elif self.is_struct_union(d):
                self.build_struct_union(name, d)
            else:
                self.build_alias(name, d)
        self.check_wire_names()

    def variant_ref(self, v: Schema) -> str | None:
        all_of = v.get("allOf", [])
        return ref_name(all_of[0]) if len(all_of) == 1 else None

    def sorted_for_defaults(self, names: list[str]) -> list[str]:
        """Order objects so that a class used as another's default is built first."""

        def default_refs(name: str) -> list[str]:
            refs = []
            for ps in self.defs[name].get("properties", {}).values():
                target = ref_name(ps)
                if isinstance(ps.get("default"), dict) and target is not None:
                    refs.append(target)
            return refs

        done: list[str] = []

        def visit(name: str) -> None:
            if name in done:
                return
            for dep in default_refs(name):
                visit(dep)
            done.append(name)

        for name in names:
            visit(name)
        return done

    def build_alias(self, name: str, d: Schema) -> None:
        doc = first_paragraph(d.get("description"))
        variants = self.union_variants(d)
        if variants and all("const" in v for v in variants if str(v.get("title", "")).lower() != "other"):
            consts = [v["const"] for v in variants if "const" in v]
            open_ended = any("const" not in v for v in variants)
            if all(isinstance(c, str) for c in consts):
                src = f"Literal[{', '.join(py_literal(c) for c in consts)}]"
                self.aliases[name] = AliasDef(name, TypeExpr(src + (" | str" if open_ended else ""), []), doc)
                return
            # Integer constants with an open "Other" (ErrorCode): an int alias plus named constants.
            for v in variants:
                if "const" in v:
                    const_name = re.sub(r"\W+", "_", v["title"]).upper()
                    self.constants.append(
                        (const_name, py_literal(v["const"]), first_paragraph(v.get("description")))
                    )
            self.aliases[name] = AliasDef(name, TypeExpr("int", []), doc)
            return
        if variants and "properties" not in d:
            target = ref_name(variants[0]) if len(variants) == 1 else None
            if target is not None:
                # A one-member union (AvailableCommandInput): new members would need a new schema.
                self.aliases[name] = AliasDef(name, TypeExpr(target, [target]), doc)
                return
            if all(v.get("type") == "array" for v in variants):
                self.build_array_union(name, d, variants)
                return
        self.aliases[name] = AliasDef(
            name, self.type_of({k: v for k, v in d.items() if k != "description"}), doc
        )

    def build_array_union(self, name: str, d: Schema, variants: list[Schema]) -> None:
        """`list[A] | list[B]` cannot be a msgspec union: use a list of the untagged union."""
        members = []
        for v in variants:
            target = ref_name(v["items"])
            if target is None:
                raise SystemExit(f"{name}: array variant without $ref items")
            self.tag_untagged(target, UNTAGGED_FIELD, SENTINEL + target)
            members.append(target)
        doc = first_paragraph(d.get("description"))
        doc += "\n\nThe wire sends one kind per list; the decoder accepts any mix."
        self.aliases[name] = AliasDef(name, TypeExpr(f"list[{' | '.join(members)}]", members), doc)

    def tag_untagged(self, target: str, tag_field: str, tag: str) -> None:
        cls = self.classes[target]
        if cls.tag_field is not None and (cls.tag_field, cls.tag) != (tag_field, tag):
            raise SystemExit(f"{target} is already tagged as {cls.tag_field}={cls.tag!r}")
        cls.tag_field, cls.tag = tag_field, tag

    def build_struct_union(self, name: str, d: Schema) -> None:
        members = []
        for v in self.union_variants(d) or []:
            target = ref_name(v)
            assert target is not None
            self.tag_untagged(target, UNTAGGED_FIELD, SENTINEL + target)
            members.append(target)
        self.aliases[name] = AliasDef(
            name, TypeExpr(" | ".join(members), members), first_paragraph(d.get("description"))
        )

    def build_tagged_union(self, name: str, d: Schema) -> None:
        variants = self.union_variants(d) or []
        tag_field = find_tag_field(variants)
        assert tag_field is not None
        own_props = d.get("properties", {})
        members: list[str] = []
        has_other = False
        for v in variants:
            props = variant_props(v)
            tag_schema = props.get(tag_field, {})
            if "const" not in tag_schema and "title" in v and tag_field in props:
                has_other = True  # "other": custom or future variants, i.e. the fallback
                continue
            wire_tag: str | None = tag_schema.get("const")
            tag = wire_tag if wire_tag is not None else SENTINEL + v["title"]
            label = wire_tag if wire_tag is not None else v["title"]
            target = self.variant_ref(v)
            extra = {k: p for k, p in props.items() if k != tag_field}
            if wire_tag is not None:
                wire_form = f"Wire form: `{json.dumps(tag_field)}: {json.dumps(wire_tag)}`."
            else:
                wire_form = (
                    f"Wire form: no `{tag_field}` (or `{json.dumps(tag_field)}: {json.dumps(label)}`)."
                )
            doc = first_paragraph(v.get("description"))
            if target is not None and target in self.absorbed and not doc:
                doc = first_paragraph(self.defs[target].get("description"))
            doc = f"{doc}\n\n{wire_form}"
            if target is not None and not own_props and not extra and self.ref_counts[target] > 1:
                # Shared definition: a tagged subclass keeps the untagged original usable.
                cls_name = VARIANT_NAMES.get((name, label), pascal(label))
                if cls_name in self.defs:
                    cls_name = name + pascal(label)
                base = self.classes[target]
                self.classes[cls_name] = ClassDef(
                    cls_name, doc, [], base=target, tag_field=tag_field, tag=tag, inherited=base.all_fields
                )
            else:
                merged: Schema = {
                    "properties": {**own_props, **extra},
                    "required": [r for r in d.get("required", []) + v.get("required", []) if r != tag_field],
                }
                if target is not None:
                    merged["allOf"] = [{"$ref": f"#/$defs/{target}"}]
                    cls_name = target if target in self.absorbed else name + pascal(label)
                else:
                    cls_name = VARIANT_NAMES.get((name, label), name + pascal(label))
                fields = self.fields_of(merged, skip=frozenset({tag_field}))
                self.classes[cls_name] = ClassDef(cls_name, doc, fields, tag_field=tag_field, tag=tag)
            members.append(cls_name)
        fallback = None
        if has_other or name not in UNKNOWN_TAG_IS_DEFAULT:
            fallback = FALLBACK_NAMES.get(name, "Unknown" + name)
            if fallback in self.classes:
                raise SystemExit(
                    f"{name}: its fallback {fallback} is one of its variants; name it in FALLBACK_NAMES"
                )
            fallback_doc = (
                f"A `{name}` that this schema version cannot represent.\n\n"
                f"Either its `{tag_field}` is unknown or its payload does not match the known variant.\n"
                "`raw` is the JSON object as received, and `encode` writes it back unchanged."
            )
            self.classes[fallback] = ClassDef(
                fallback, fallback_doc, [], base="UnknownVariant", tag_field=tag_field, tag=UNKNOWN_TAG
            )
            members.append(fallback)
        self.unions[name] = UnionDef(
            name, first_paragraph(d.get("description")), tag_field, members, fallback
        )
        self.aliases[name] = AliasDef(name, TypeExpr(" | ".join(members), members), self.unions[name].doc)

    def check_wire_names(self) -> None:
        for cls in self.classes.values():
            attrs = [f.attr for f in cls.all_fields]
            if len(set(attrs)) != len(attrs):
                raise SystemExit(f"{cls.name}: attribute names collide: {attrs}")
            # Annotations are evaluated in the class body, where a field named `list` hides the
            # builtin from the annotations after it.
            for i, f in enumerate(cls.fields):
                later = " ".join(g.type.src for g in cls.fields[i + 1 :])
                if re.search(rf"\b{re.escape(f.attr)}\b", later):
                    raise SystemExit(f"{cls.name}.{f.attr} shadows a name used by a later annotation")

    # -- methods -------------------------------------------------------------------------

    def methods(self) -> dict[str, list[tuple[str, str, str, str | None]]]:
        """Per side: (constant, method, params type, result type or None), from x-method / x-side.

        Methods are listed in the schema order of their params types; the constant is the method
        name in capitals (`session/new` -> SESSION_NEW, `$/cancel_request` -> CANCEL_REQUEST).
        """
        found: dict[str, dict[str, str]] = {}
        sides: dict[str, str] = {}
        for name, d in self.defs.items():
            method = d.get("x-method")
            if method is None:
                continue
            role = "result" if name.endswith("Response") else "params"
            if role in found.setdefault(method, {}):
                raise SystemExit(f"{method}: two {role} types")
            found[method][role] = name
            side = d.get("x-side")
            if side not in METHOD_SIDES:
                raise SystemExit(f"{name}: x-side {side!r} is not one of {list(METHOD_SIDES)}")
            if sides.setdefault(method, side) != side:
                raise SystemExit(f"{method}: params and result disagree on x-side")
        for method, types in found.items():
            if "params" not in types:
                raise SystemExit(f"{method}: a {types['result']} but no params type")
        order = list(self.defs)
        tables: dict[str, list[tuple[str, str, str, str | None]]] = {side: [] for side in METHOD_SIDES}
        constants: dict[str, str] = {}
        for method, types in sorted(found.items(), key=lambda item: order.index(item[1]["params"])):
            const = re.sub(r"\W+", "_", method.removeprefix("$/")).strip("_").upper()
            if constants.setdefault(const, method) != method:
                raise SystemExit(f"{method} and {constants[const]} both make the constant {const}")
            tables[sides[method]].append((const, method, types["params"], types.get("result")))
        return tables

    # -- emission ------------------------------------------------------------------------

    def emit_order(self) -> list[str]:
        """Schema order, each name moved after the names it needs (depth first)."""
        nodes: dict[str, ClassDef | AliasDef] = {}
        for name in self.order:
            if name in self.aliases:
                nodes[name] = self.aliases[name]
            if name in self.classes:
                nodes[name] = self.classes[name]
            # Classes created for this definition's union (variants, fallback) come with it.
            union = self.unions.get(name)
            for member in union.members if union else []:
                nodes.setdefault(member, self.classes[member])
        for name, cls in self.classes.items():
            nodes.setdefault(name, cls)
        done: list[str] = []
        visiting: set[str] = set()

        def visit(name: str) -> None:
            if name in done:
                return
            if name in visiting:
                raise SystemExit(f"reference cycle through {name}: needs quoted annotations")
            visiting.add(name)
            for dep in nodes[name].deps():
                if dep != name:
                    visit(dep)
            visiting.discard(name)
            done.append(name)

        for name in nodes:
            visit(name)
        return done

    def render(self, source: Source) -> str:
        methods = self.methods()
        out: list[str] = []
        out.append(HEADER_NOTE.format(file="schema.json") + "\n# Regenerate with: make schema\n")
        out.append(f"# Source: npm {source.package} {source.version}, {source.path}\n")
        out.append(f"# ACP schema release: {source.release or 'not recorded'}\n")
        out.append(f"# schema.json sha256: {source.sha256}\n")
        out.append(MODULE_HEAD)
        # isort's order, which `ruff check` enforces: classes (capitalised) before functions.
        imported = sorted(RUNTIME_PUBLIC + RUNTIME_PRIVATE, key=lambda n: (n[:1].islower(), n))
        out.append("from subagent.acp._wire import (\n" + "".join(f"    {n},\n" for n in imported) + ")\n\n")
        out.append(f"SCHEMA_SOURCE: Final = {json.dumps(f'{source.package}@{source.version}')}\n")
        out.append(
            '"""The npm package (name@version) whose `schema.json` these types were generated from."""\n'
        )
        release = "None" if source.release is None else json.dumps(source.release)
        out.append(f"SCHEMA_RELEASE: Final[str | None] = {release}\n")
        out.append(
            '"""The ACP schema release the package was built from; None where it is not recorded."""\n'
        )
        out.append(f"SCHEMA_SHA256: Final = {json.dumps(source.sha256)}\n")
        out.append('"""sha256 of the `schema.json` these types were generated from."""\n')
        out.append(f"PROTOCOL_VERSION: Final = {source.protocol_version}\n")
        out.append('"""The ACP protocol version spoken here (sent in `initialize`)."""\n\n')
        for name in self.emit_order():
            if name in self.classes:
                out.append(self.render_class(self.classes[name]))
            else:
                out.append(self.render_alias(self.aliases[name]))
        out.append("\n# Error codes (`ErrorCode`); any other integer is allowed too.\n")
        for const_name, src, comment in self.constants:
            out.append(f"{const_name}: Final = {src}\n")
            out.append((docstring(comment, "") if comment else "") + "\n")
        out.append(self.render_methods(methods))
        out.append(self.render_lenient(sorted(self.classes)))
        public = sorted(
            set(self.classes)
            | set(self.aliases)
            | {c for c, _, _ in self.constants}
            | {row[0] for rows in methods.values() for row in rows}
            | set(RUNTIME_PUBLIC)
            | set(MODULE_PUBLIC)
        )
        out.append("\n__all__ = [\n" + "".join(f"    {json.dumps(n)},\n" for n in public) + "]\n")
        return "".join(out)

    def render_class(self, cls: ClassDef) -> str:
        options = "kw_only=True, frozen=True"
        if cls.tag_field is not None:
            options += f", tag_field={json.dumps(cls.tag_field)}, tag={json.dumps(cls.tag)}"
        lines = [f"\n\nclass {cls.name}({cls.base}, {options}):\n"]
        lines.append(docstring(cls.doc or cls.name, "    "))
        for f in cls.fields:
            lines.append("\n")
            explicit_name = f.wire != to_camel(f.attr)
            if f.default is None:
                value = f" = msgspec.field(name={json.dumps(f.wire)})" if explicit_name else ""
            elif explicit_name:
                value = f" = msgspec.field(default={f.default}, name={json.dumps(f.wire)})"
            else:
                value = f" = {f.default}"
            lines.append(f"    {f.attr}: {f.type.src}{value}\n")
            if f.doc:
                lines.append(docstring(f.doc, "    "))
        return "".join(lines)

    def render_alias(self, alias: AliasDef) -> str:
        text = f"\n\n{alias.name}: TypeAlias = {alias.type.src}\n"
        return text + (docstring(alias.doc, "") if alias.doc else "")

    def render_methods(self, methods: dict[str, list[tuple[str, str, str, str | None]]]) -> str:
        out = ["\n\n# Method names and their wire types (x-method / x-side).\n"]
        for rows in methods.values():
            for const, method, _, _ in rows:
                out.append(f"{const}: Final = {json.dumps(method)}\n")
        titles = {
            "agent": "Methods the agent handles (the client sends them).",
            "client": "Methods the client handles (the agent sends them).",
            "protocol": "Protocol-level methods either side may send and must accept.",
        }
        for side, rows in methods.items():
            out.append(
                f"\n{side.upper()}_METHODS: Final[Mapping[str, MethodTypes]] = MappingProxyType(\n    {{\n"
            )
            for const, _, params, result in rows:
                out.append(f"        {const}: MethodTypes({params}, {result}),\n")
            out.append("    }\n)\n")
            out.append(docstring(titles[side] + " A result of None marks a notification.", ""))
        return "".join(out)

    def render_unstable(self, source: Source, stable: Generator) -> str:
        """The module of the `UNSTABLE_DEFINITIONS`, importing what else they use from the stable one."""
        emitted: set[str] = set()
        for name in UNSTABLE_DEFINITIONS:
            if name not in self.classes and name not in self.aliases:
                raise SystemExit(f"UNSTABLE_DEFINITIONS: {name} is not generated from the unstable schema")
            emitted.add(name)
            union = self.unions.get(name)
            emitted.update(union.members if union else ())
        imported: set[str] = set()
        for name in emitted:
            node = self.classes.get(name) or self.aliases[name]
            for dep in node.deps():
                if dep not in emitted:
                    imported.add(dep)
        for dep in sorted(imported):
            if dep not in stable.classes and dep not in stable.aliases:
                raise SystemExit(f"{dep} is not in the stable schema: add it to UNSTABLE_DEFINITIONS")
            if strip_docs(self.defs.get(dep)) != strip_docs(stable.defs.get(dep)):
                raise SystemExit(f"{dep} differs from the stable schema's: add it to UNSTABLE_DEFINITIONS")
        out: list[str] = []
        out.append(HEADER_NOTE.format(file="schema.unstable.json") + "\n# Regenerate with: make schema\n")
        out.append(f"# Source: npm {source.package} {source.version}, {source.unstable_path}\n")
        out.append(f"# schema.unstable.json sha256: {source.unstable_sha256}\n")
        out.append(UNSTABLE_MODULE_HEAD)
        out.append("from subagent.acp._wire import UnknownVariant, WireStruct, register_lenient_fields\n")
        out.append(
            "from subagent.acp.schema import (\n" + "".join(f"    {n},\n" for n in sorted(imported)) + ")\n\n"
        )
        out.append(f"UNSTABLE_SCHEMA_SHA256: Final = {json.dumps(source.unstable_sha256)}\n")
        out.append('"""sha256 of the `schema.unstable.json` these types were generated from."""\n\n')
        for name in self.emit_order():
            if name not in emitted:
                continue
            if name in self.classes:
                out.append(self.render_class(self.classes[name]))
            else:
                out.append(self.render_alias(self.aliases[name]))
        out.append(self.render_lenient(sorted(n for n in emitted if n in self.classes)))
        public = sorted(emitted | {"UNSTABLE_SCHEMA_SHA256"})
        out.append("\n__all__ = [\n" + "".join(f"    {json.dumps(n)},\n" for n in public) + "]\n")
        return "".join(out)

    def render_lenient(self, names: list[str]) -> str:
        out = [
            "\n\n# Fields marked x-deserialize-default-on-error, x-deserialize-skip-invalid-items and\n"
            "# x-deserialize-default-on-null, by wire name: the tolerant decoder resets the first kind,\n"
            "# filters the second and reads null as the default for the third.\n"
            "_LENIENT: Final[Mapping[type, tuple[frozenset[str], frozenset[str], frozenset[str]]]] = "
            "MappingProxyType(\n    {\n"
        ]

        def literal(names: list[str]) -> str:
            return f"frozenset({{{', '.join(json.dumps(n) for n in names)}}})" if names else "frozenset()"

        for name in names:
            fields = self.classes[name].all_fields
            reset = sorted(f.wire for f in fields if f.default_on_error)
            skip = sorted(f.wire for f in fields if f.skip_invalid_items)
            null = sorted(f.wire for f in fields if f.default_on_null)
            if reset or skip or null:
                out.append(f"        {name}: ({literal(reset)}, {literal(skip)}, {literal(null)}),\n")
        out.append("    }\n)\n")
        out.append("register_lenient_fields(_LENIENT)\n")
        return "".join(out)


# --------------------------------------------------------------------------------------------
# The fixed head of the generated module. The hand-written runtime (base classes, method table row,
# codec and tolerant repair) lives in `subagent/acp/_wire.py`, where it is linted and type-checked;
# the generated module imports it and re-exports its public names.

MODULE_HEAD: Final = '''
"""ACP wire types, generated from the vendored JSON Schema (protocol version 1).

Every object is a frozen, keyword-only msgspec struct. Attributes are snake_case and the wire is
camelCase; `_meta` is the attribute `meta`. Optional fields default to None or to the schema's
default. String enums are `Literal` aliases.

Use `decode(data, type=T)` and `encode(value)` rather than bare msgspec calls:

* Decoding is one typed msgspec decode. Only when that fails does `decode` parse the JSON again
  and repair it the way the schema allows: an unknown union tag (a new `sessionUpdate` kind, a new
  content `type`) becomes that union's `Unknown*` member with the object kept in `raw`; fields
  marked default-on-error fall back to their default; invalid items of lenient lists are dropped;
  a null where the schema says default-on-null reads as the default (an empty list).
  Unknown fields are ignored everywhere.
* Some variants have no tag on the wire (stdio MCP servers, `agent` auth methods, embedded text
  or blob resources) and the fallbacks must write back exactly what was read. They carry internal
  tags that start with NUL, which `encode` strips; bare `msgspec.json.encode` would leak them.

The base classes and the codec are hand-written in `subagent.acp._wire` and re-exported here.
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final, Literal, TypeAlias

import msgspec

'''

UNSTABLE_MODULE_HEAD: Final = '''
"""ACP wire types of the unstable schema that the client uses: the subagents draft.

Generated like `subagent.acp.schema` (same base classes, same codec: use `decode`, `convert` and
`encode` from there), from `schema.unstable.json`, for the definitions the generator lists. They
may change or go with any release of the schema. The unstable session updates (`subagent_update`,
`session_message`...) decode as `schema.UnknownSessionUpdate`; `convert(update.raw,
type=SubagentUpdate)` reads one.
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final, TypeAlias

import msgspec

'''

# Names the generated module imports from `subagent.acp._wire` and lists in its `__all__`.
RUNTIME_PUBLIC: Final = [
    "MethodTypes",
    "UnknownVariant",
    "WireStruct",
    "convert",
    "decode",
    "encode",
    "to_builtins",
]
# Imported from `subagent.acp._wire` for the generated module's own use, not re-exported.
RUNTIME_PRIVATE: Final = ["register_lenient_fields"]
# Defined by the generated module itself, outside the schema's definitions.
MODULE_PUBLIC: Final = ["PROTOCOL_VERSION", "SCHEMA_RELEASE", "SCHEMA_SHA256", "SCHEMA_SOURCE"]


# --------------------------------------------------------------------------------------------
# Entry points


@dataclass(frozen=True)
class Source:
    """Where the vendored `schema.json` came from, as `source.json` records it."""

    package: str
    version: str
    path: str  # the file's path inside the package tarball
    release: str | None  # the ACP schema release, when it could be established
    protocol_version: int
    sha256: str
    unstable_path: str
    unstable_sha256: str


def read_source(schema_dir: Path) -> Source:
    """Read `source.json` and check each vendored file against its recorded sha256."""
    record = json.loads((schema_dir / "source.json").read_text(encoding="utf-8"))
    for name, entry in record["files"].items():
        digest = hashlib.sha256((schema_dir / name).read_bytes()).hexdigest()
        if digest != entry["sha256"]:
            raise SystemExit(
                f"{name}: sha256 {digest} is not the one source.json records ({entry['sha256']})"
            )
    main = record["files"]["schema.json"]
    unstable = record["files"]["schema.unstable.json"]
    return Source(
        unstable_path=unstable["from"],
        unstable_sha256=unstable["sha256"],
        package=record["package"],
        version=record["version"],
        path=main["from"],
        release=record.get("schemaRelease"),
        protocol_version=int(record["protocolVersion"]),
        sha256=main["sha256"],
    )


def ruff_format(source: str, path: Path) -> str:
    """Format with the project's ruff so the committed file passes `ruff format --check`."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(path), "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"ruff format failed:\n{result.stderr}")
    return result.stdout


def strip_docs(node: Any) -> Any:
    """A schema without its descriptions: what two definitions must share to be the same type."""
    if isinstance(node, dict):
        return {k: strip_docs(v) for k, v in node.items() if k not in ("description", "title")}
    if isinstance(node, list):
        return [strip_docs(v) for v in node]
    return node


def generate(
    schema_dir: Path = SCHEMA_DIR, output: Path = OUTPUT, unstable_output: Path = UNSTABLE_OUTPUT
) -> tuple[str, str]:
    """Return the sources of the two generated modules: the stable types and the unstable ones."""
    source = read_source(schema_dir)
    generator = Generator(json.loads((schema_dir / "schema.json").read_bytes()))
    generator.build()
    unstable = Generator(json.loads((schema_dir / "schema.unstable.json").read_bytes()))
    unstable.build()
    return (
        ruff_format(generator.render(source), output),
        ruff_format(unstable.render_unstable(source, generator), unstable_output),
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if the output file is stale")
    parser.add_argument("--schema-dir", type=Path, default=SCHEMA_DIR, help="directory of schema.json")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="module to write")
    parser.add_argument(
        "--unstable-output", type=Path, default=UNSTABLE_OUTPUT, help="module of unstable types to write"
    )
    args = parser.parse_args(argv)
    sources = generate(args.schema_dir, args.output, args.unstable_output)
    status = 0
    for output, source in zip((args.output, args.unstable_output), sources, strict=True):
        current = output.read_text(encoding="utf-8") if output.exists() else ""
        if args.check:
            if current != source:
                diff = difflib.unified_diff(
                    current.splitlines(keepends=True),
                    source.splitlines(keepends=True),
                    "committed",
                    "generated",
                    n=1,
                )
                excerpt = "".join(list(diff)[:40])
                print(f"{output} is stale: regenerate it with `make schema`.\n{excerpt}", file=sys.stderr)
                status = 1
        elif current != source:
            output.write_text(source, encoding="utf-8")
            print(f"wrote {output}")
    return status


if __name__ == "__main__":
    sys.exit(main())
