"""Template YAML read strictly and within bounds, as Kandev's Go decoder reads it. Pure (CPU-bound: the
runtime parses on a worker thread).

`parse_yaml` is the one entry: safe loading, no aliases, repeated keys and deep nesting refused, integers and
timestamps never converted beyond what a template can hold, the count limits (`workflow_counts.py`) measured
as the text is read. libyaml reads the text when PyYAML has it; PyYAML's pure-Python loader is the reference
every other path agrees with, and words each refusal.
"""

import re
import typing
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar, cast

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

try:
    from yaml._yaml import CParser as _CParser  # libyaml, when PyYAML was built with it
except ImportError:  # pragma: no cover - PyYAML's wheels ship libyaml
    _CParser = None  # type: ignore[assignment,misc]

from onceflow.protocol.errors import shown
from onceflow.protocol.limits import INT64_MAX, INT64_MIN, MAX_TEMPLATE_ACTIONS, MAX_YAML_DEPTH
from onceflow.protocol.template.counts import (
    ACTIONS_BOUND,
    STEPS_BOUND,
    TRIGGER_KEYS,
    count_problem,
    rules_problem,
)
from onceflow.protocol.template.problems import Loc

T = TypeVar("T")


class _HugeInt(int):
    """An integer literal too long for int64, kept as a value just outside int64 so the field's bound
    reports it where it stands (step and field); it shows how many digits were written."""

    digits: int

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


_INT_TEXT_LIMIT = 70  # an int64 in any YAML 1.1 form ("0b" + 64 binary digits, sign, base-60) is shorter


class _BoundedComposer(Composer):
    """PyYAML's composer, bounded for untrusted text: aliases are refused (no Kandev template uses one, and
    an alias bomb expands exponentially); mappings and sequences nest at most MAX_YAML_DEPTH levels (the
    composer recurses per level; a node inside MAX_YAML_DEPTH collections is one level too deep)."""

    _depth = 0

    if typing.TYPE_CHECKING:

        def peek_event(self) -> Any: ...

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event: yaml.Event = self.peek_event()
        mark = cast(yaml.Mark, event.start_mark)
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, f"YAML aliases (*{event.anchor}) are not allowed in a template", mark
            )
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _StrictConstructor(SafeConstructor):
    """PyYAML's safe constructor, as Kandev's Go decoder reads a template: a key repeated within one
    mapping is refused; a scalar YAML 1.1 reads as a timestamp stays its text (a date object, or
    `2001-13-45`'s ValueError, never escapes); an integer literal longer than int64 is never converted
    (Python refuses beyond 4,300 digits); a scalar an explicit tag makes unreadable (`!!int nope`,
    `!!bool maybe`) is a ConstructorError at its line, never a ValueError."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = str(self.construct_scalar(node)).replace("_", "")
        if len(text) <= _INT_TEXT_LIMIT:
            return self._tagged(node, "an integer", super().construct_yaml_int)
        huge = _HugeInt(INT64_MIN - 1 if text.startswith("-") else INT64_MAX + 1)
        huge.digits = len(re.sub(r"^[-+]?(0[xob])?", "", text))
        return huge

    def construct_timestamp_text(self, node: yaml.ScalarNode) -> str:
        return str(self.construct_scalar(node))

    def construct_tagged_float(self, node: yaml.ScalarNode) -> float:
        return self._tagged(node, "a float", super().construct_yaml_float)

    def construct_tagged_bool(self, node: yaml.ScalarNode) -> bool:
        return self._tagged(node, "a boolean", super().construct_yaml_bool)

    def _tagged(self, node: yaml.ScalarNode, kind: str, construct: Callable[[yaml.ScalarNode], T]) -> T:
        """`construct(node)`, a scalar an explicit tag (`!!float nope`) made unreadable refused naming it."""
        try:
            return construct(node)
        except (ValueError, KeyError):
            message = f"{shown(node.value)} is not {kind}"
            raise yaml.constructor.ConstructorError(None, None, message, node.start_mark) from None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictConstructor.yaml_constructors = {
    **SafeConstructor.yaml_constructors,
    "tag:yaml.org,2002:int": _StrictConstructor.construct_yaml_int,
    "tag:yaml.org,2002:timestamp": _StrictConstructor.construct_timestamp_text,
    "tag:yaml.org,2002:float": _StrictConstructor.construct_tagged_float,
    "tag:yaml.org,2002:bool": _StrictConstructor.construct_tagged_bool,
}


class _StrictLoader(_BoundedComposer, _StrictConstructor, yaml.SafeLoader):
    """PyYAML's pure-Python safe loader, bounded and strict: the reference every other path must agree
    with, and the words a refusal uses. Its scanner also refuses deep flow nesting as it scans."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def fetch_flow_collection_start(self, TokenClass: type[yaml.Token]) -> None:
        # The scanner looks ahead up to 1,024 characters per possible key, each step costing the flow
        # depth: refuse deep `[[[[...` as it is scanned rather than after that lookahead.
        if self.flow_level >= MAX_YAML_DEPTH:
            raise yaml.scanner.ScannerError(
                None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", self.get_mark()
            )
        super().fetch_flow_collection_start(TokenClass)


class _Unbounded(Exception):
    """The node graph libyaml composed holds an alias or nests too deep: `_StrictLoader` must say where."""


def _check_nodes(root: yaml.Node, aliases: bool) -> None:
    """Raise _Unbounded when a node lies deeper than `_BoundedComposer` allows or, if the text may hold
    `aliases` (it has both an `&` and a `*`), when a node is reached twice; one pass, level by level."""
    seen: set[int] = set()
    level, depth = [root], 1
    while level:
        if depth > MAX_YAML_DEPTH:
            raise _Unbounded
        if aliases:
            before = len(seen)
            seen.update(map(id, level))
            if len(seen) != before + len(level):
                raise _Unbounded
        below: list[yaml.Node] = []
        for node in level:
            if isinstance(node, yaml.MappingNode):
                for pair in node.value:
                    below += pair
            elif isinstance(node, yaml.SequenceNode):
                below += node.value
        level, depth = below, depth + 1


_CLoader: type[_StrictConstructor] | None = None
if _CParser is not None:

    class _CStrictLoader(_StrictConstructor, _CParser, Resolver):
        """libyaml's scanner, parser and composer (C) under `_StrictConstructor` (Python); the node graph
        is checked against `_BoundedComposer`'s rules before anything is constructed (raises _Unbounded).
        libyaml stops any nesting at 1,000 levels on its own."""

        def __init__(self, stream: bytes) -> None:
            _CParser.__init__(self, stream)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)
            self._aliases = b"&" in stream and b"*" in stream  # an alias needs an anchor and a reference

        def get_single_data(self) -> Any:
            node = self.get_single_node()
            if node is None:
                return None
            _check_nodes(node, self._aliases)
            return self.construct_document(node)

    _CLoader = _CStrictLoader


_SCALAR_TAGS = frozenset(
    f"tag:yaml.org,2002:{kind}" for kind in ("null", "bool", "int", "float", "binary", "timestamp", "str")
)
_MAPPING_TAGS = frozenset({None, "!", "tag:yaml.org,2002:map"})
_SEQUENCE_TAGS = frozenset({None, "!", "tag:yaml.org,2002:seq"})
_NO_KEY = object()


class _NotPlain(Exception):
    """`_read_events` met what only the node-based loaders read or word: an anchor or alias, a tag other than
    a scalar's or a plain map's or seq's, a merge (`<<`) or value (`=`) key, a collection as a key, a
    repeated key, a second document, nesting deeper than MAX_YAML_DEPTH, a scalar the constructor refuses."""


class OverCount(Exception):
    """A count limit broken, found while the text is read: `loc` and `message` as `first_count_problem`
    gives them; `data` holds the steps read so far (the one at `loc` complete, so its id is known)."""

    def __init__(self, loc: Loc, message: str, data: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message
        self.data = data


def _read_events(encoded: bytes) -> Any:
    """The YAML value of `encoded`, built straight from libyaml's events, as `_StrictLoader` reads it; the
    count limits are measured as each list ends, and the first one broken stops the reading.

    One pass, no node graph: each scalar is resolved and constructed by `_StrictConstructor` as the
    node-based loaders do (once per distinct tag, text and implicitness: a repeated one reuses the value,
    floats apart); mappings and sequences become dicts and lists in document order. Raises
    OverCount for the first count problem `first_count_problem` would find in the same text (raised once
    the step it lies in has been read); _NotPlain for anything it leaves to the node-based loaders (see
    there), which then read the whole text again; yaml.YAMLError where libyaml's parser refuses the text.
    """
    next_event = _CParser(encoded).get_event
    scalar, mapping_start, sequence_start = yaml.ScalarEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent
    mapping_end, sequence_end = yaml.MappingEndEvent, yaml.SequenceEndEvent
    constructor = _StrictConstructor()
    resolve: Callable[..., str] = Resolver().resolve  # (node class, value, implicit) -> tag
    read: dict[tuple[str | None, str, tuple[bool, bool]], Any] = {}  # a scalar as written -> its value
    open_: list[Any] = []  # the open mappings and sequences, outermost first
    slots: list[Any] = []  # where each open one goes in its parent: key, index, or None for the root
    keys: list[Any] = []  # each open mapping's key awaiting its value, or _NO_KEY
    root: Any = None
    documents = 0
    over: tuple[Loc, str] | None = None
    while True:
        event: Any = next_event()  # the stubs type it `Event | None`; branches test its type
        kind = type(event)
        if kind is scalar:
            if len(open_) >= MAX_YAML_DEPTH or event.anchor is not None:
                raise _NotPlain
            written = (event.tag, event.value, event.implicit)
            value = read.get(written, _NO_KEY)
            if value is _NO_KEY:
                value = _construct_scalar(event, constructor, resolve)
                if type(value) is not float:  # each NaN stays its own object, as the node loaders make it
                    read[written] = value
        elif kind is mapping_start or kind is sequence_start:
            mapping = kind is mapping_start
            tags = _MAPPING_TAGS if mapping else _SEQUENCE_TAGS
            if len(open_) >= MAX_YAML_DEPTH or event.tag not in tags or event.anchor is not None:
                raise _NotPlain
            if not open_:
                slots.append(None)
            elif type(open_[-1]) is list:
                slots.append(len(open_[-1]))
            elif keys[-1] is _NO_KEY:
                raise _NotPlain  # a mapping or sequence as a key
            else:
                slots.append(keys[-1])
            open_.append({} if mapping else [])
            keys.append(_NO_KEY)
            continue
        elif kind is mapping_end or kind is sequence_end:
            value = open_.pop()
            keys.pop()
            if over is None and (
                len(value) > MAX_TEMPLATE_ACTIONS
                or (len(open_) == 5 and kind is mapping_end and value.get("type") == "configure_session")
            ):
                over = _over_count(value, open_, slots)
            slots.pop()
        elif kind is yaml.DocumentStartEvent:
            documents += 1
            if documents > 1:
                raise _NotPlain
            continue
        elif kind is yaml.StreamEndEvent:
            return root
        elif kind is yaml.AliasEvent:
            raise _NotPlain
        else:  # the stream's start, a document's end
            continue
        if not open_:
            root = value
        elif type(parent := open_[-1]) is list:
            parent.append(value)
        elif keys[-1] is _NO_KEY:
            if value in parent:
                raise _NotPlain  # a repeated key: the constructor words it
            keys[-1] = value
        else:
            parent[keys[-1]] = value
            keys[-1] = _NO_KEY
        if over is not None and len(open_) <= 2:  # the step holding the problem is read: its id is known
            raise OverCount(*over, {"steps": open_[1] if len(open_) == 2 else value})


def _construct_scalar(event: Any, constructor: _StrictConstructor, resolve: Callable[..., str]) -> Any:
    """The value of a ScalarEvent, resolved and constructed as the node loaders do; _NotPlain when its tag
    is not a scalar's or the constructor refuses it (the node loaders word that)."""
    tag = event.tag
    if tag is None or tag == "!":
        tag = resolve(yaml.ScalarNode, event.value, event.implicit)
    if tag not in _SCALAR_TAGS:
        raise _NotPlain
    node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)
    try:
        return _StrictConstructor.yaml_constructors[tag](constructor, node)
    except yaml.YAMLError:
        raise _NotPlain from None


def _over_count(closed: Any, open_: list[Any], slots: list[Any]) -> tuple[Loc, str] | None:
    """The count problem of the mapping or sequence `closed` has just ended, if it is a counted one: the
    steps list, a trigger's actions, or a configure_session action's rules. `open_` holds its parents;
    `slots[i]` is where `open_[i]` (or, last, `closed`) goes in its parent."""
    depth = len(open_)
    if depth == 0 or type(open_[0]) is not dict or slots[1] != "steps":
        return None
    if depth == 1:
        return count_problem(closed, STEPS_BOUND, ("steps",)) if type(closed) is list else None
    if depth < 4 or type(open_[1]) is not list or type(open_[2]) is not dict or type(open_[3]) is not dict:
        return None
    if slots[3] != "events" or slots[4] not in TRIGGER_KEYS:
        return None
    where: Loc = ("steps", slots[2], "events", slots[4])
    if depth == 4 and type(closed) is list:
        return count_problem(closed, ACTIONS_BOUND, where)
    if depth == 5 and type(open_[4]) is list and type(closed) is dict:
        return rules_problem(closed, (*where, slots[5]))
    return None


def parse_yaml(text: str, encoded: bytes) -> Any:
    """The YAML value of `text` (`encoded` is its UTF-8, lone surrogates kept so libyaml refuses them), as
    `_StrictLoader` reads it. Raises yaml.YAMLError; OverCount for a count limit broken (see
    `_read_events`), before the rest of the text is read.

    Read by libyaml when PyYAML has it: first straight from its events (`_read_events`, ~1.7x faster than
    a node graph), then, for what that leaves to the node-based loaders, composed in C, checked for
    aliases and depth, and constructed by `_StrictConstructor`. A refusal by the constructor's rules
    comes from the same Python code on both paths. Anything else libyaml refuses, or that breaks the
    composer's rules, is read again by `_StrictLoader`, so the refusal has its words and marks: libyaml's
    scanner and parser word their errors otherwise, and `_StrictLoader` refuses deep flow nesting as it
    scans, before the composer would.
    """
    if _CLoader is not None:
        try:
            return _read_events(encoded)
        except _NotPlain:
            try:
                return yaml.load(encoded, Loader=_CLoader)  # type: ignore[arg-type]
            except yaml.constructor.ConstructorError:
                raise
            except (yaml.YAMLError, _Unbounded):
                pass
        except yaml.YAMLError:
            pass
    return yaml.load(text, Loader=_StrictLoader)


def yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"{exc.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return str(exc)
