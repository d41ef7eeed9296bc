"""onceflow: an embeddable Trio runtime that dispatches workflow-step triggers exactly once.

The public API: `open_runtime` (an async context manager yielding a `Runtime`), the `Host` protocol and
`RecordingHost`, the `Coordinator` protocol and what it is handed and returns (outcome delivery in Gas
City's wire format: `OutcomeEnvelope`, `OutcomeDeliveryRequest`, `OutcomeDelivery`, `OutcomeAcknowledgement`,
`derive_outcome_id`, `DeliveryRequest`, `AcknowledgeRequest`, `RetryPolicy`), `Durability`, and the typed
errors. Commands and events live in `onceflow.protocol`.
"""

from onceflow.actors.coordinator import AcknowledgeRequest, Coordinator, DeliveryRequest, RetryPolicy
from onceflow.actors.host import Host, RecordingHost, SessionActionRequest
from onceflow.actors.supervisor import Runtime, open_runtime
from onceflow.protocol.errors import OnceflowError
from onceflow.protocol.outcome import (
    Evidence,
    OutcomeAcknowledgement,
    OutcomeDelivery,
    OutcomeDeliveryRequest,
    OutcomeEnvelope,
    ProducerFence,
    derive_outcome_id,
)
from onceflow.store.lock import DatabaseOwnedError
from onceflow.store.writer import Durability

__all__ = [
    "AcknowledgeRequest",
    "Coordinator",
    "DatabaseOwnedError",
    "DeliveryRequest",
    "Durability",
    "Evidence",
    "Host",
    "OnceflowError",
    "OutcomeAcknowledgement",
    "OutcomeDelivery",
    "OutcomeDeliveryRequest",
    "OutcomeEnvelope",
    "ProducerFence",
    "RecordingHost",
    "RetryPolicy",
    "Runtime",
    "SessionActionRequest",
    "derive_outcome_id",
    "open_runtime",
]
