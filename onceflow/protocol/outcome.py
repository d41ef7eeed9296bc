"""Coordinator outcomes in Gas City's wire format: envelope, delivery request, receipt, acknowledgement. Pure:
the wire, no thread.

The objects and rules are those of Gas City's producers and coordinators (gascity-wire-format.md), so a Go
producer's JSON is accepted as it is and what onceflow hands a coordinator is what a Gas City coordinator
expects. They are pydantic v2 models: every rejection is a ValidationError whose location names the field
(over the protocol, `error.field` is e.g. `envelope.evidence.0.uri`). The three commands (`outcome_ready`,
`coordinator_ack`, `get_outcome`) wrap them with a `type` tag.

The spec has no acceptance-criterion ids of its own; `onceflow.actors.runtime.outcome` lists the AC-CO-n ids
the code and tests use. This module holds AC-CO-1 (validation), AC-CO-2 (outcome id derivation), AC-CO-5
(receipt) and the shape of AC-CO-16 (acknowledged_by).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from onceflow.protocol.field_docs import describe_fields
from onceflow.protocol.limits import INT64_MAX, INT64_MIN
from onceflow.protocol.times import RFC3339_UTC
from onceflow.protocol.tracecontext import TraceContext

CONTRACT_VERSION = 1

SEGMENT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
Segment = Annotated[str, StringConstraints(pattern=SEGMENT_PATTERN)]
"""An identifier segment: 1-128 characters, a letter or digit first, then letters, digits, `.`, `_`, `-`."""

StoreRef = Annotated[str, StringConstraints(pattern=r"^(city|rig):[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
"""The store an outcome belongs to: `city:<segment>` or `rig:<segment>`."""

OutcomeId = Annotated[str, StringConstraints(pattern=r"^outcome-[0-9a-f]{32}$")]
"""A derived outcome id: `outcome-` and 32 lowercase hex digits (see `derive_outcome_id`)."""


def _contract_version(value: int) -> int:
    if value != CONTRACT_VERSION:
        raise ValueError(f"must be {CONTRACT_VERSION}")
    return value


ContractVersion = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX), AfterValidator(_contract_version)]
"""The contract version: the JSON integer 1 (as Go decodes an int: not 1.0, not true)."""

Producer = Literal["direct-worker", "formula-step", "project-lead", "maintenance-order", "temporal"]
OutcomeState = Literal["terminal", "verified"]
EvidenceKind = Literal["commit", "patch", "review-record", "test-report"]
URI_SCHEMES = frozenset({"bead", "file", "git", "https", "s3"})

# Go's unicode.IsSpace, which Gas City's strings.TrimSpace checks use (Python's strip also takes \x1c-\x1f).
GO_SPACE = (
    "\t\n\v\f\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
)


def _text(limit: int, forbidden: str) -> Callable[[str], str]:
    """A check for prose fields: non-empty, trimmed, none of `forbidden`, at most `limit` UTF-8 bytes."""
    named = ", ".join(repr(ch) for ch in forbidden)

    def check(value: str) -> str:
        if not value:
            raise ValueError("must not be empty")
        if value != value.strip(GO_SPACE):
            raise ValueError("must not start or end with whitespace")
        if any(ch in forbidden for ch in value):
            raise ValueError(f"must not contain {named}")
        if len(value.encode()) > limit:
            raise ValueError(f"must be at most {limit} bytes of UTF-8")
        return value

    return check


def _uri(value: str) -> str:
    scheme, colon, rest = value.partition(":")
    if not colon or not rest or scheme not in URI_SCHEMES:
        raise ValueError(f"must be a URI scheme:rest with scheme {', '.join(sorted(URI_SCHEMES))}")
    if any(ch in GO_SPACE for ch in value):
        raise ValueError("must not contain whitespace")
    if len(value.encode()) > 512:
        raise ValueError("must be at most 512 bytes of UTF-8")
    return value


def _delivery_ref(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    if any(ch in GO_SPACE or not ch.isprintable() for ch in value):
        raise ValueError("must not contain whitespace or control characters")
    if len(value.encode()) > 512:
        raise ValueError("must be at most 512 bytes of UTF-8")
    return value


def _occurred_at(value: str) -> str:
    match = RFC3339_UTC.match(value)  # the protocol's one time format (protocol/times.py)
    if match is None:
        raise ValueError("must be an RFC 3339 timestamp in UTC, e.g. 2026-03-01T12:00:00Z (offset Z)")
    try:
        seconds = datetime.strptime(match[1], "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        raise ValueError("must be a real date and time") from None
    if seconds == datetime(1, 1, 1) and not (match[2] or "").strip("0"):
        raise ValueError("must not be the zero time")
    return value


def _workflow_id(value: str | None) -> str | None:
    return None if value is None else _text(255, "\x00\r\n\t")(value)


def _absent_when_empty(value: object) -> object:
    # Go decodes "" and null to the zero string, which Gas City treats (and emits, omitempty) as absent.
    return None if value == "" else value


class _Message(BaseModel):
    # Field docstrings are the descriptions `onceflow schema` and docs/protocol.md show.
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=describe_fields)


class Evidence(_Message):
    """One piece of evidence for an outcome: what it is, where it lives, and its SHA-256 (lowercase hex)."""

    kind: EvidenceKind
    """What the evidence is."""
    uri: Annotated[str, Field(max_length=512), AfterValidator(_uri)]
    """Where it lives: a `bead:`, `file:`, `git:`, `https:` or `s3:` URI, at most 512 bytes."""
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    """Its SHA-256, 64 lowercase hex digits."""


class ProducerFence(_Message):
    """The envelope's `fence`: who produced the outcome, in which generation (> 0, a Go int), under which
    token."""

    producer_id: Segment
    """The producer."""
    generation: StrictInt = Field(gt=0, le=INT64_MAX)
    """The producer's generation, a positive integer."""
    token: Segment
    """The producer's fencing token."""


def derive_outcome_id(
    *,
    producer: str,
    store_ref: str,
    work_id: str,
    state: str,
    fence: ProducerFence | Mapping[str, Any],
    contract_version: int = CONTRACT_VERSION,
) -> str:
    """The outcome id an envelope must carry (AC-CO-2; gascity-wire-format.md, outcome_id derivation).

    `"outcome-"` + lowercase hex of the first 16 bytes of the SHA-256 of this compact JSON, keys in exactly
    this order: `{"contract_version":1,"producer":..,"store_ref":..,"work_id":..,"state":..,
    "fence":{"producer_id":..,"generation":..,"token":..}}`. Every hashed string is validated first (an
    enum value, `city:`/`rig:` + segment, or a segment: ASCII letters, digits and `.` `_` `-` `:`), so
    no JSON escaping ever applies and the bytes are the ones Go's json.Marshal writes.

    Raises:
        pydantic.ValidationError: a field breaks its envelope rule (the error's location names it).
    """
    identity = _Identity.model_validate(
        {
            "contract_version": contract_version,
            "producer": producer,
            "store_ref": store_ref,
            "work_id": work_id,
            "state": state,
            "fence": fence if isinstance(fence, ProducerFence) else dict(fence),
        }
    )
    canonical = json.dumps(
        {
            "contract_version": identity.contract_version,
            "producer": identity.producer,
            "store_ref": identity.store_ref,
            "work_id": identity.work_id,
            "state": identity.state,
            "fence": {
                "producer_id": identity.fence.producer_id,
                "generation": identity.fence.generation,
                "token": identity.fence.token,
            },
        },
        separators=(",", ":"),
    )
    return "outcome-" + hashlib.sha256(canonical.encode()).digest()[:16].hex()


class _Identity(_Message):
    contract_version: ContractVersion
    producer: Producer
    store_ref: StoreRef
    work_id: Segment
    state: OutcomeState
    fence: ProducerFence


_OmittedWhenEmpty = Field(default=None, exclude_if=lambda value: value is None)


# Validated as AC-CO-1 requires; the outcome id rule is AC-CO-2.
class OutcomeEnvelope(_Message):
    """Gas City's `OutcomeReady`: an agent's outcome for the coordinator, validated.

    Fields, in the order a Go producer writes them: contract_version (1), outcome_id, producer, store_ref,
    work_id, source_root_id, workflow_id and workflow_run_id (optional; "" or null mean absent, and absent
    ones are omitted on output), step_key, summary (<= 512 bytes, no NUL/CR), impact (<= 1024 bytes, no
    NUL/CR), state, evidence (1-64), fence, occurred_at (RFC 3339 in UTC with `Z`, up to nanoseconds, kept
    exactly as received; not the zero time). `outcome_id` must equal `derive_outcome_id` of the envelope's
    own fields. Every failure names its field.
    """

    contract_version: ContractVersion
    """The wire contract's version: the integer 1."""
    outcome_id: OutcomeId
    """`derive_outcome_id` of the envelope's producer, store_ref, work_id, state and fence."""
    producer: Producer
    """What kind of producer made the outcome."""
    store_ref: StoreRef
    """The store the work belongs to: `city:<segment>` or `rig:<segment>`."""
    work_id: Segment
    """The unit of work the outcome is for."""
    source_root_id: Segment
    """The root of the work's source."""
    workflow_id: Annotated[
        Annotated[str, Field(max_length=255)] | None,
        BeforeValidator(_absent_when_empty),
        AfterValidator(_workflow_id),
    ] = _OmittedWhenEmpty
    """The workflow the work ran in, if any ("" or null: absent; omitted on output when absent)."""
    workflow_run_id: Annotated[Segment | None, BeforeValidator(_absent_when_empty)] = _OmittedWhenEmpty
    """The workflow run, if any (needs `workflow_id`)."""
    step_key: Segment
    """The step of the work the outcome ends."""
    summary: Annotated[str, Field(max_length=512), AfterValidator(_text(512, "\x00\r"))]
    """What was done: non-empty, trimmed, no NUL or CR, at most 512 bytes of UTF-8."""
    impact: Annotated[str, Field(max_length=1024), AfterValidator(_text(1024, "\x00\r"))]
    """What it changes: non-empty, trimmed, no NUL or CR, at most 1024 bytes of UTF-8."""
    state: OutcomeState
    """`terminal` (the work ended) or `verified` (and was checked)."""
    evidence: list[Evidence] = Field(min_length=1, max_length=64)
    """What backs the outcome: 1 to 64 pieces."""
    fence: ProducerFence
    """Who produced the outcome, in which generation."""
    occurred_at: Annotated[str, Field(max_length=64), AfterValidator(_occurred_at)]
    """When, as RFC 3339 in UTC with `Z` (up to nanoseconds; kept exactly as received)."""

    @field_validator("workflow_run_id")
    @classmethod
    def _run_needs_workflow(cls, run_id: str | None, info: ValidationInfo) -> str | None:
        if run_id is not None and info.data.get("workflow_id") is None:
            raise ValueError("a workflow_run_id needs a workflow_id")
        return run_id

    @model_validator(mode="after")
    def _derived(self) -> Self:
        expected = derive_outcome_id(
            producer=self.producer,
            store_ref=self.store_ref,
            work_id=self.work_id,
            state=self.state,
            fence=self.fence,
        )
        if self.outcome_id != expected:
            error = PydanticCustomError(
                "outcome_id_mismatch",
                "does not match the envelope's content (expected {expected})",
                {"expected": expected},
            )
            details = InitErrorDetails(type=error, loc=("outcome_id",), input=self.outcome_id)
            raise ValidationError.from_exception_data(type(self).__name__, [details])
        return self


# AC-CO-4.
class OutcomeDeliveryRequest(_Message):
    """What a coordinator's local delivery adapter receives: `{envelope, delivery_cycle}`.

    `delivery_cycle` names the redelivery round (`cycle-000003`); every attempt of one round repeats it.
    """

    envelope: OutcomeEnvelope
    """The outcome to deliver."""
    delivery_cycle: Segment
    """The redelivery round (`cycle-000003`); every attempt of one round repeats it."""


# AC-CO-5.
class OutcomeDelivery(_Message):
    """The coordinator's receipt for one delivery cycle: `{delivery_ref, coordinator_fence}`.

    `delivery_ref` is the adapter's idempotent local reference, any URI-like string (`bead:hq-mail-42`):
    non-empty, no whitespace or control characters, <= 512 bytes of UTF-8. `coordinator_fence` (a segment)
    names the coordinator session that received it. `outcome_id` and `work_id` may be included (Gas City's
    recorded-delivery form); validate with `context={"envelope": envelope}` to require that they are the
    envelope's.
    """

    model_config = ConfigDict(
        extra="forbid", frozen=True, revalidate_instances="always", json_schema_extra=describe_fields
    )

    outcome_id: Segment | None = _OmittedWhenEmpty
    """The delivered outcome (optional; when given, the envelope's)."""
    work_id: Segment | None = _OmittedWhenEmpty
    """The delivered outcome's work (optional; when given, the envelope's)."""
    delivery_ref: Annotated[str, Field(max_length=512), AfterValidator(_delivery_ref)]  # bytes: checked
    """The adapter's idempotent local reference (`bead:hq-mail-42`)."""
    coordinator_fence: Segment
    """The coordinator session that received the delivery."""

    @field_validator("outcome_id", "work_id")
    @classmethod
    def _same_outcome(cls, value: str | None, info: ValidationInfo) -> str | None:
        envelope = (info.context or {}).get("envelope")
        expected = value if envelope is None or value is None else getattr(envelope, str(info.field_name))
        if value != expected:
            raise ValueError(f"changed outcome identity (the envelope has {expected})")
        return value


# AC-CO-9 (what completes the outcome) and AC-CO-16 (acknowledged_by).
class OutcomeAcknowledgement(_Message):
    """Gas City's acknowledgement: `{store_ref, outcome_id, work_id, coordinator_fence, acknowledged_by}`.

    It completes the outcome only when store ref, outcome id and work id are the envelope's and the fence is
    the current delivery's. `acknowledged_by` (a segment) names who acknowledged; once the outcome is
    acknowledged, the same `acknowledged_by` again is a no-op and a different one a conflict.
    """

    store_ref: StoreRef
    """The envelope's store_ref."""
    outcome_id: Segment
    """The envelope's outcome_id."""
    work_id: Segment
    """The envelope's work_id."""
    coordinator_fence: Segment
    """The fence of the delivery being acknowledged (the current one, or the acknowledgement is stale)."""
    acknowledged_by: Segment
    """Who acknowledged; the same one again is a no-op, another one a `conflict`."""


# AC-CO-11.
class OutcomeReady(_Message, TraceContext):
    """Command `outcome_ready`: start delivering `envelope`, or count a repeat of it."""

    type: Literal["outcome_ready"] = "outcome_ready"
    """The command name."""
    envelope: OutcomeEnvelope
    """The outcome, in Gas City's wire format."""


class CoordinatorAck(OutcomeAcknowledgement, TraceContext):
    """Command `coordinator_ack`: an `OutcomeAcknowledgement` with the command's `type` tag."""

    type: Literal["coordinator_ack"] = "coordinator_ack"
    """The command name."""


# The coordinator-outcome-state query of AC-CO-3.
class GetOutcome(_Message, TraceContext):
    """Query `get_outcome`: the outcome's durable state (phase, attempts, receipt, acknowledgement)."""

    type: Literal["get_outcome"] = "get_outcome"
    """The command name."""
    outcome_id: OutcomeId
    """The outcome."""
