"""Coordinator outcome delivery on the wire: the envelope, the receipt, the acknowledgement, three commands.

Gas City's coordinator-outcome-delivery.md ships these as a Temporal workflow's input and signals. Here they
are pydantic v2 models: every rejection is a ValidationError whose location names the field (over the
protocol, `error.field` is e.g. `envelope.evidence.0.uri`).

The spec has no acceptance-criterion ids of its own; `onceflow.actors.outcome` lists the AC-CO-n ids the
code and tests use. This module holds AC-CO-1 (envelope validation) and AC-CO-2 (outcome id derivation).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from onceflow.protocol.limits import INT64_MAX

CONTRACT_VERSION = 1

SEGMENT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
Segment = Annotated[str, StringConstraints(pattern=SEGMENT_PATTERN)]
"""An identifier segment: 1-128 characters, a letter or digit first, then letters, digits, `.`, `_`, `-`."""

StoreRef = Annotated[str, StringConstraints(pattern=r"^(city|rig):[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
"""The store an outcome belongs to: `city:<segment>` or `rig:<segment>`."""

OutcomeId = Annotated[str, StringConstraints(pattern=r"^outcome-[0-9a-f]{32}$")]

WorkflowId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,254}$")]
"""A correlated Temporal workflow id: like a segment, up to 255 characters, also allowing `:` and `/`."""

Producer = Literal["direct-worker", "formula-step", "project-lead", "maintenance-order", "temporal"]
EvidenceKind = Literal["commit", "patch", "review-record", "test-report"]
URI_SCHEMES = frozenset({"bead", "file", "git", "https", "s3"})


def _text(limit: int) -> Callable[[str], str]:
    """A check for prose fields: non-empty, already trimmed, no NUL or CR, at most `limit` UTF-8 bytes."""

    def check(value: str) -> str:
        if not value:
            raise ValueError("must not be empty")
        if value != value.strip():
            raise ValueError("must not start or end with whitespace")
        if "\x00" in value or "\r" in value:
            raise ValueError("must not contain NUL or CR")
        if len(value.encode()) > limit:
            raise ValueError(f"must be at most {limit} bytes of UTF-8")
        return value

    return check


def _uri(value: str) -> str:
    scheme, colon, rest = value.partition(":")
    if not colon or not rest or scheme not in URI_SCHEMES:
        raise ValueError(f"must be a URI with scheme {', '.join(sorted(URI_SCHEMES))}")
    if any(ch.isspace() or not ch.isprintable() for ch in value):
        raise ValueError("must not contain whitespace or control characters")
    if len(value.encode()) > 512:
        raise ValueError("must be at most 512 bytes of UTF-8")
    return value


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Evidence(_Message):
    """One piece of evidence for an outcome: what it is, where it lives, and its SHA-256 (lowercase hex)."""

    kind: EvidenceKind
    uri: Annotated[str, Field(max_length=512), AfterValidator(_uri)]
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class ProducerFence(_Message):
    """The producer's fence: who produced the outcome, in which generation (> 0), under which token."""

    producer_id: Segment
    generation: StrictInt = Field(gt=0, le=INT64_MAX)
    token: Segment


def derive_outcome_id(
    *, producer: Producer, store_ref: str, work_id: str, state: str, producer_fence: ProducerFence
) -> str:
    """The outcome id an envelope must carry (AC-CO-2): `outcome-` + the first 32 hex of a SHA-256.

    The digest is over the UTF-8 of this canonical JSON (keys sorted, no whitespace):
    `{"fence":{"generation":G,"producer_id":P,"token":T},"producer":..,"state":..,"store_ref":..,
    "version":1,"work_id":..}`. Summary, impact, evidence and times do not change the id.
    """
    canonical = json.dumps(
        {
            "version": CONTRACT_VERSION,
            "producer": producer,
            "store_ref": store_ref,
            "work_id": work_id,
            "state": state,
            "fence": producer_fence.model_dump(),
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return "outcome-" + hashlib.sha256(canonical.encode()).hexdigest()[:32]


class OutcomeEnvelope(_Message):
    """An agent's outcome for the coordinator (the spec's `OutcomeReady` envelope), validated (AC-CO-1).

    `occurred_at` is Unix seconds. A `run_id` needs a `workflow_id`. `outcome_id` must equal
    `derive_outcome_id` of the envelope's own fields (AC-CO-2). Fields are validated in declaration order,
    and each failure names its field.
    """

    contract_version: Literal[1]
    producer: Producer
    store_ref: StoreRef
    work_id: Segment
    source_root_id: Segment
    step_key: Segment
    workflow_id: WorkflowId | None = None
    run_id: Segment | None = None
    summary: Annotated[str, Field(max_length=512), AfterValidator(_text(512))]  # the schema shows the bound
    impact: Annotated[str, Field(max_length=1024), AfterValidator(_text(1024))]
    state: Literal["terminal", "verified"]
    evidence: list[Evidence] = Field(min_length=1, max_length=64)
    producer_fence: ProducerFence
    occurred_at: float = Field(gt=0, allow_inf_nan=False)
    outcome_id: OutcomeId

    @field_validator("run_id")
    @classmethod
    def _run_needs_workflow(cls, run_id: str | None, info: ValidationInfo) -> str | None:
        if run_id is not None and info.data.get("workflow_id") is None:
            raise ValueError("a run_id needs a workflow_id")
        return run_id

    @field_validator("outcome_id")
    @classmethod
    def _derived(cls, outcome_id: str, info: ValidationInfo) -> str:
        parts = ("producer", "store_ref", "work_id", "state", "producer_fence")
        if all(part in info.data for part in parts):  # otherwise an earlier field already failed
            expected = derive_outcome_id(**{part: info.data[part] for part in parts})
            if outcome_id != expected:
                raise ValueError(f"does not match the envelope's content (expected {expected})")
        return outcome_id


class OutcomeDelivery(_Message):
    """The coordinator's receipt for one delivery cycle (AC-CO-5).

    Validate it with `context={"envelope": envelope}` to also require the envelope's outcome and work id.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, revalidate_instances="always")

    outcome_id: OutcomeId
    work_id: Segment
    delivery_ref: Segment
    coordinator_fence: Segment

    @field_validator("outcome_id", "work_id")
    @classmethod
    def _same_outcome(cls, value: str, info: ValidationInfo) -> str:
        envelope = (info.context or {}).get("envelope")
        expected = value if envelope is None else getattr(envelope, str(info.field_name))
        if value != expected:
            raise ValueError(f"changed outcome identity (the envelope has {expected})")
        return value


class OutcomeReady(_Message):
    """Command `outcome_ready`: start delivering `envelope`, or count a repeat of it (AC-CO-11)."""

    type: Literal["outcome_ready"] = "outcome_ready"
    envelope: OutcomeEnvelope


class CoordinatorAck(_Message):
    """Command `coordinator_ack`: the coordinator acknowledges the delivery it received under its fence.

    It completes the outcome only when all four fields match the outcome's current delivery (AC-CO-9).
    """

    type: Literal["coordinator_ack"] = "coordinator_ack"
    store_ref: StoreRef
    outcome_id: OutcomeId
    work_id: Segment
    coordinator_fence: Segment


class GetOutcome(_Message):
    """Query `get_outcome`: the outcome's state, as the spec's `coordinator-outcome-state` query (AC-CO-3)."""

    type: Literal["get_outcome"] = "get_outcome"
    outcome_id: OutcomeId
