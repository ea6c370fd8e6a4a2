"""Runtime support for the generated ACP wire types in :mod:`subagent.acp.schema`.

The generated module holds only what the JSON Schema decides (the structs, aliases, method tables
and the table of lenient fields); everything hand-written lives here, where it is linted and
type-checked like the rest of the package. `subagent.acp.schema` imports this module and
re-exports its public names, and that is where callers should import them from.

What is here:

* `WireStruct`, the base of every generated struct, and `UnknownVariant`, the base of the
  `Unknown*` fallback member of every open tagged union;
* `MethodTypes`, the row type of the generated method tables;
* the codec: `decode` / `convert` (one typed msgspec decode; a tolerant repair only when that
  fails), `encode` / `to_builtins` (which write fallbacks back as received and strip internal
  tags).

Internal tags start with NUL (`\\x00`): variants that have no tag on the wire get one so that
msgspec can tell them apart, and `encode` takes it out again. `scripts/gen_schema.py` assigns
those tags and must use the same prefix.

The generated module tells the repair which fields are lenient with `register_lenient_fields`
when it is imported, since only it knows them.
"""

import builtins
from collections.abc import Mapping
from typing import Any, Final, NamedTuple, TypeAlias, TypeVar, overload

import msgspec
from msgspec import inspect as mi

__all__ = [
    "MethodTypes",
    "UnknownVariant",
    "WireStruct",
    "convert",
    "decode",
    "encode",
    "register_lenient_fields",
    "to_builtins",
]


# --------------------------------------------------------------------------------------------
# Base classes


class WireStruct(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True, rename="camel", gc=False):
    """Base class of every ACP object: frozen, keyword-only, camelCase on the wire.

    Fields equal to their default are left out when encoding, and unknown fields are ignored
    when decoding. Instances are not tracked by the cyclic garbage collector (``gc=False``):
    decoded JSON is a tree and the objects are frozen, so they cannot form a cycle by themselves,
    and a turn keeps every update: tracking them made the collector rescan a growing heap and
    doubled the cost of a streamed update.
    """


class UnknownVariant(WireStruct, kw_only=True, frozen=True):
    """Base class of the `Unknown*` fallback member that every open tagged union has."""

    raw: dict[str, Any]
    """The JSON object as received; `encode` writes exactly this object back."""

    @property
    def tag(self) -> str | None:
        """The discriminator value in `raw`, or None when it is absent or not a string."""
        tag_field = self.__struct_config__.tag_field
        value = self.raw.get(tag_field) if tag_field is not None else None
        return value if isinstance(value, str) else None


class MethodTypes(NamedTuple):
    """The wire types of one method: a struct class, or a union alias of them."""

    params: Any
    """The type of the request's or notification's `params`."""
    result: Any
    """The type of the response's `result`, or None for a notification."""


# --------------------------------------------------------------------------------------------
# Codec

_T = TypeVar("_T")

_SENTINEL: Final = "\x00"
"""Internal tags start with NUL: msgspec escapes it as ``\\u0000``, so `encode` can spot them cheaply."""
_ESCAPED_SENTINEL: Final = b"\\u0000"
_MISSING: Final = object()

LenientFields: TypeAlias = tuple[frozenset[str], frozenset[str], frozenset[str]]
"""Wire names of a struct's fields: (reset to the default on error, drop invalid list items, null
means the default)."""

_NOT_LENIENT: Final[LenientFields] = (frozenset(), frozenset(), frozenset())

_LENIENT: Final[dict[type, LenientFields]] = {}
"""Fields marked x-deserialize-default-on-error, x-deserialize-skip-invalid-items and
x-deserialize-default-on-null, by struct class: filled by the generated module through
`register_lenient_fields`."""

_ENCODER: Final = msgspec.json.Encoder()
_DECODERS: dict[Any, msgspec.json.Decoder[Any]] = {}
"""A decoder per target type, built once and reused, so the fast path is a lookup and a decode."""
_TYPE_INFO: dict[Any, mi.Type] = {}
"""The `msgspec.inspect` type tree of each target type, built once too."""


def register_lenient_fields(table: Mapping[type, LenientFields]) -> None:
    """Tell the tolerant decoder which fields of which structs it may reset or filter.

    Each value is (wire names that fall back to their default when invalid, wire names of lists
    whose invalid items are dropped, wire names where null stands for the default). The generated
    module calls this once, with the table it derives from the schema's `x-deserialize-*` markers.
    """
    _LENIENT.update(table)


@overload
def decode(data: bytes | bytearray | memoryview | str, *, type: builtins.type[_T]) -> _T: ...
@overload
def decode(data: bytes | bytearray | memoryview | str, *, type: Any) -> Any: ...
def decode(data: bytes | bytearray | memoryview | str, *, type: Any) -> Any:
    """Decode JSON (bytes, str or `msgspec.Raw`) into `type`, tolerating unknown variants.

    Raises `msgspec.DecodeError` for malformed JSON and `msgspec.ValidationError` when the
    value does not fit `type` even after the repairs the schema allows.
    """
    decoder = _DECODERS.get(type)
    if decoder is None:
        decoder = _DECODERS.setdefault(type, msgspec.json.Decoder(type))
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        error = exc
    # The slow path, taken only by messages that need repair.
    return _repair_and_convert(msgspec.json.decode(data), type, error)


@overload
def convert(obj: Any, *, type: builtins.type[_T]) -> _T: ...
@overload
def convert(obj: Any, *, type: Any) -> Any: ...
def convert(obj: Any, *, type: Any) -> Any:
    """Like `decode`, for a value already parsed into Python builtins (dicts, lists, ...)."""
    try:
        return msgspec.convert(obj, type)
    except msgspec.ValidationError as exc:
        error = exc
    return _repair_and_convert(obj, type, error)


def encode(value: Any) -> bytes:
    """Encode a wire value (or any structure containing them) as compact JSON.

    Fallbacks are written as their `raw` object and internal tags are left out.
    """
    data = _ENCODER.encode(value)
    if _ESCAPED_SENTINEL in data:
        # An internal tag is in there (or a string with a NUL in it): redo it the careful way.
        data = _ENCODER.encode(to_builtins(value))
    return data


def to_builtins(value: Any) -> Any:
    """Convert a wire value to the JSON-ready builtins that `encode` would write."""
    return _restore(value, msgspec.to_builtins(value))


def _restore(value: Any, built: Any) -> Any:
    # Walk the value and msgspec's builtins side by side, fixing what msgspec cannot know.
    if isinstance(value, UnknownVariant):
        return value.raw
    if isinstance(value, msgspec.Struct):
        config = value.__struct_config__
        if config.tag_field is not None and isinstance(config.tag, str) and config.tag.startswith(_SENTINEL):
            del built[config.tag_field]
        for attr, key in zip(value.__struct_fields__, value.__struct_encode_fields__, strict=True):
            if key in built:
                built[key] = _restore(getattr(value, attr), built[key])
        return built
    if isinstance(value, list | tuple):
        return [_restore(item, out) for item, out in zip(value, built, strict=True)]
    if isinstance(value, dict):
        pairs = zip(value.values(), built.items(), strict=True)
        return {key: _restore(item, out) for item, (key, out) in pairs}
    return built


# --------------------------------------------------------------------------------------------
# Tolerant repair: the slow path of `decode` and `convert`


class _Invalid(Exception):
    """Raised inside the repair walk for a value that cannot be made to fit its type."""


class _UnionInfo(NamedTuple):
    """What the repair needs to know about a union, worked out once per union type."""

    plain: mi.StructType | None
    tag_field: str | None
    by_tag: dict[str, mi.StructType]
    untagged: list[mi.StructType]
    fallback: mi.StructType | None
    others: list[mi.Type]


_UNION_INFO: dict[int, _UnionInfo] = {}
"""Keyed by id(): inspect types are unhashable, and the cached type trees keep them alive."""


def _repair_and_convert(obj: Any, type: Any, error: msgspec.ValidationError) -> Any:
    info = _TYPE_INFO.get(type)
    if info is None:
        info = _TYPE_INFO.setdefault(type, mi.type_info(type))
    try:
        repaired = _repair(obj, info, skip_items=False)
    except _Invalid:
        raise error from None
    return msgspec.convert(repaired, type)


def _repair(value: Any, t: mi.Type, skip_items: bool) -> Any:
    """Return `value` reshaped so that msgspec accepts it as `t`, or raise `_Invalid`."""
    if isinstance(t, mi.StructType):
        return _repair_struct(value, t)
    if isinstance(t, mi.UnionType):
        return _repair_union(value, t, skip_items)
    if isinstance(t, mi.ListType):
        if not isinstance(value, list):
            raise _Invalid
        if not skip_items:
            return [_repair(item, t.item_type, False) for item in value]
        kept: list[Any] = []
        for item in value:
            try:
                kept.append(_repair(item, t.item_type, False))
            except _Invalid:
                continue
        return kept
    if isinstance(t, mi.DictType):
        if not isinstance(value, dict):
            raise _Invalid
        return {key: _repair(item, t.value_type, False) for key, item in value.items()}
    if isinstance(t, mi.AnyType):
        return value
    if isinstance(t, mi.NoneType):
        ok = value is None
    elif isinstance(t, mi.BoolType):
        ok = isinstance(value, bool)
    elif isinstance(t, mi.IntType):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(t, mi.FloatType):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif isinstance(t, mi.StrType):
        ok = isinstance(value, str)
    elif isinstance(t, mi.LiteralType):
        ok = isinstance(value, str | int) and not isinstance(value, bool) and value in t.values
    else:
        return value  # not produced by the generated types; msgspec.convert has the last word
    if not ok:
        raise _Invalid
    return value


def _repair_struct(value: Any, t: mi.StructType) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid
    reset, skip, null_default = _LENIENT.get(t.cls, _NOT_LENIENT)
    out = dict(value)
    if t.tag_field is not None:
        out[t.tag_field] = t.tag
    for f in t.fields:
        key = f.encode_name
        if key in null_default and out.get(key, _MISSING) is None:
            # Null stands for the default: absent where the field is optional, empty where a
            # required list or map (stdio `args`, `mcpServers`) has no other default.
            if not f.required:
                del out[key]
            elif isinstance(f.type, mi.ListType):
                out[key] = []
            elif isinstance(f.type, mi.DictType):
                out[key] = {}
        if key not in out:
            if f.required:
                raise _Invalid
            continue
        try:
            out[key] = _repair(out[key], f.type, key in skip)
        except _Invalid:
            if key not in reset:
                raise
            if not f.required:
                del out[key]
            elif isinstance(f.type, mi.ListType):
                out[key] = []
            else:
                raise
    return out


def _repair_union(value: Any, t: mi.UnionType, skip_items: bool) -> Any:
    info = _UNION_INFO.get(id(t))
    if info is None:
        info = _UNION_INFO.setdefault(id(t), _union_info(t))
    if isinstance(value, dict) and info.plain is not None:
        return _repair_struct(value, info.plain)  # `SomeStruct | None`: no tag to look at
    if isinstance(value, dict) and info.tag_field is not None:
        tag = value.get(info.tag_field, _MISSING)
        if isinstance(tag, str) and tag in info.by_tag:
            candidates = [info.by_tag[tag]]
        elif tag is _MISSING or info.fallback is None:
            candidates = info.untagged  # the variant(s) without a wire tag
        else:
            candidates = []
        for member in candidates:
            try:
                return _repair_struct(value, member)
            except _Invalid:
                continue
        if info.fallback is not None:
            return {info.tag_field: info.fallback.tag, "raw": value}
        raise _Invalid
    for other in info.others:
        try:
            return _repair(value, other, skip_items)
        except _Invalid:
            continue
    raise _Invalid


def _union_info(t: mi.UnionType) -> _UnionInfo:
    plain: mi.StructType | None = None
    tag_field: str | None = None
    by_tag: dict[str, mi.StructType] = {}
    untagged: list[mi.StructType] = []
    fallback: mi.StructType | None = None
    others: list[mi.Type] = []
    for member in t.types:
        if not isinstance(member, mi.StructType):
            others.append(member)
            continue
        tag_field = member.tag_field
        tag = member.tag
        if tag_field is None:
            plain = member  # msgspec allows one untagged struct per union, and then no tagged ones
        elif issubclass(member.cls, UnknownVariant):
            fallback = member
        elif isinstance(tag, str) and tag.startswith(_SENTINEL):
            untagged.append(member)
            # The schema names the untagged variant ("stdio", "agent"): accept it spelled out.
            by_tag.setdefault(tag[1:], member)
        elif isinstance(tag, str):
            by_tag[tag] = member
    return _UnionInfo(plain, tag_field, by_tag, untagged, fallback, others)
