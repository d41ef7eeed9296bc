"""onceflow: an embeddable Trio runtime that dispatches workflow-step triggers exactly once.

The public API: `open_runtime` (an async context manager yielding a `Runtime`), the `Host` protocol and
`RecordingHost`, the `Coordinator` protocol (outcome delivery), `Durability`, and the typed errors.
Commands and events live in `onceflow.protocol`.
"""

from onceflow.actors.coordinator import Coordinator
from onceflow.actors.host import Host, RecordingHost, SessionActionRequest
from onceflow.actors.supervisor import Runtime, open_runtime
from onceflow.protocol.errors import OnceflowError
from onceflow.store.lock import DatabaseOwnedError
from onceflow.store.writer import Durability

__all__ = [
    "Coordinator",
    "DatabaseOwnedError",
    "Durability",
    "Host",
    "OnceflowError",
    "RecordingHost",
    "Runtime",
    "SessionActionRequest",
    "open_runtime",
]
