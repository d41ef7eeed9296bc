"""Limits a host can rely on: every size and range the protocol and the template loader accept. Pure.

One place for the numbers; the command models (`commands.py`) and the template loader (`workflow.py`)
declare them, so `onceflow schema` shows them as `maxLength`, `maxItems`, `minimum`/`maximum` and `pattern`.
Anything beyond a limit is refused with a typed error naming the field, before it is stored or remembered.
`Runtime.send` never raises, whatever the bytes: it answers with an error reply.
"""

from __future__ import annotations

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
"""Every integer field: SQLite stores signed 64-bit integers."""

MAX_ID_CHARS = 256
"""Ids (task, step, workflow, agent, comment, decision, ...): at most this many characters, no control
characters. A trigger's operation id is built from ids and is remembered for the process's lifetime."""

ID_PATTERN = r"^[^\x00-\x1F\x7F-\x9F]*$"
"""No C0 or C1 control character and no DEL (a newline in an id could forge a log or trace line)."""

MAX_TRACESTATE_CHARS = 8_192
"""A command's W3C `tracestate` (protocol/tracecontext.py): at most this many printable ASCII characters
(32 list members of a 256-character key and value each would need more; the W3C spec asks that at least 512
be propagated)."""

MAX_TEXT_CHARS = 16_384
"""Free text (titles, decision comments): at most this many characters."""

MAX_SOURCE_CHARS = 4_096
"""`register_workflow.source`, the label (usually a path) errors name: characters, no control characters."""

MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""One JSON line on the wire, in UTF-8 bytes (room for a maximal template escaped as a JSON string)."""

MAX_JSON_DEPTH = 64
"""Nesting of arrays and objects in one JSON message (a command needs 4)."""

MAX_LIST_ITEMS = 1_000
"""Items in one list of a command (`children_completed.children`)."""

MAX_TEMPLATE_BYTES = 128 * 1024
"""A workflow template's YAML text, in UTF-8 bytes (Kandev's largest is ~6 KB; a 1,000-step chain ~100 KB)."""
# Small enough that a template refused only at its end (a count broken by its last trigger) is still read
# and refused in well under 100 ms.

MAX_TEMPLATE_STEPS = 1_000
"""Steps in one workflow template."""

MAX_TEMPLATE_ACTIONS = 64
"""Actions declared for one trigger of one step (and rules of one configure_session)."""

MAX_YAML_DEPTH = 64
"""Nesting of mappings and sequences in a template (a queue_run payload lives at depth 6)."""

MAX_PAYLOAD_BYTES = 64 * 1024
"""A template's `payload` / `config_options` mapping, as UTF-8 bytes of its canonical JSON."""
