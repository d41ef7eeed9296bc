"""Flow control's commands: `set_limits`, `pause`, `resume`, `list_pauses` and `queue_stats`. Trio thread:
each is one store transaction (store/runs/flow.py); a change commits, then a `flow_changed` event wakes every
waiting claim (actors/kernel/run_signals.py), which looks again under the new limits.
"""

from __future__ import annotations

from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.kernel.services import Services
from onceflow.protocol import commands as c
from onceflow.protocol.events import FlowChanged
from onceflow.protocol.results import (
    AgentQueueStats,
    LimitInfo,
    PauseInfo,
    PauseList,
    PauseResult,
    QueueStatsResult,
    ResumeResult,
)
from onceflow.protocol.times import rfc3339
from onceflow.store.runs import flow

LIMIT_FIELDS = ("max_concurrent", "runs_per_hour")


def limit_info(limit: flow.Limit) -> LimitInfo:
    """A limit as replies show it."""
    return {
        "scope": limit.scope,
        "id": limit.target_id if limit.scope == "agent" else None,
        "max_concurrent": limit.max_concurrent,
        "runs_per_hour": limit.runs_per_hour,
    }


def pause_info(pause: flow.Pause) -> PauseInfo:
    """A pause as replies show it."""
    return {
        "scope": pause.scope,
        "id": pause.target_id if pause.scope != "all" else None,
        "reason": pause.reason,
        "paused_at": rfc3339(pause.paused_at),
    }


async def set_limits(services: Services, command: c.SetLimits, out: Outbox) -> LimitInfo:
    """`set_limits`: the limits named in the command (a field left out is kept, null removes it)."""
    changes = {name: getattr(command, name) for name in LIMIT_FIELDS if name in command.model_fields_set}
    limit = await services.store.transact(
        flow.set_limits, command.scope, command.id or "", changes, services.now()
    )
    out.emit(
        FlowChanged(
            change="limits_set",
            scope=command.scope,
            id=command.id,
            max_concurrent=limit.max_concurrent,
            runs_per_hour=limit.runs_per_hour,
        )
    )
    return limit_info(limit)


async def pause(services: Services, command: c.Pause, out: Outbox) -> PauseResult:
    """`pause`: the scope's runs are not handed out until `resume` (a paused scope keeps its first pause)."""
    held, created = await services.store.transact(
        flow.pause, command.scope, command.id or "", command.reason, services.now()
    )
    if created:
        out.emit(FlowChanged(change="paused", scope=command.scope, id=command.id, reason=command.reason))
    return {"pause": pause_info(held), "created": created}


async def resume(services: Services, command: c.Resume, out: Outbox) -> ResumeResult:
    """`resume`: lift the scope's pause (a no-op, `resumed` false, when it was not paused)."""
    resumed = await services.store.transact(flow.resume, command.scope, command.id or "")
    if resumed:
        out.emit(FlowChanged(change="resumed", scope=command.scope, id=command.id))
    return {"resumed": resumed}


async def list_pauses(services: Services) -> PauseList:
    """`list_pauses`: every pause, oldest first."""
    pauses = await services.store.transact(flow.list_pauses)
    return {"pauses": [pause_info(p) for p in pauses]}


async def queue_stats(services: Services) -> QueueStatsResult:
    """`queue_stats`: per agent, the limits and the pauses (store/runs/flow.py `queue_stats`)."""
    agents, limits, pauses, now = await services.store.transact(flow.queue_stats, services.now())
    rows: list[AgentQueueStats] = [
        {
            "agent_profile_id": a.agent_profile_id,
            "queued": a.queued,
            "claimed": a.claimed,
            "max_concurrent": a.max_concurrent,
            "runs_per_hour": a.runs_per_hour,
            "oldest_age_s": a.oldest_age,
            "paused": a.paused,
            "rate_limited_last_hour": a.rate_limited_last_hour,
        }
        for a in agents
    ]
    return {
        "agents": rows,
        "limits": [limit_info(limit) for limit in limits],
        "pauses": [pause_info(p) for p in pauses],
        "as_of": rfc3339(now),
    }
