"""A workflow's graph as SVG drawn on the server: its steps left to right by position, its transitions as
arrows labelled with the trigger that takes them. Pure (no script, nothing fetched: the board shows it as an
image).
"""

from __future__ import annotations

from html import escape
from typing import Any

from onceflow.protocol.errors import OnceflowError
from onceflow.protocol.workflow import TRANSITION_TYPES, Workflow, load_workflow_text, workflow_from_dict

BOX_W, BOX_H, GAP = 150, 48, 60
TOP = 150  # room above the boxes for forward arcs
ARC = 26  # extra height per step an arc spans


def transitions(workflow: Workflow) -> list[tuple[str, str, str]]:
    """(from step, to step, trigger) for each transition action, in step then trigger order; a
    `move_to_next` of the last step (or `move_to_previous` of the first) leads nowhere and is left out."""
    found: list[tuple[str, str, str]] = []
    for step in workflow.steps:
        for trigger, actions in step.events:
            for action in actions:
                if action.type not in TRANSITION_TYPES:
                    continue
                if action.type == "move_to_next":
                    target = workflow.next_step(step.id)
                elif action.type == "move_to_previous":
                    target = workflow.previous_step(step.id)
                else:
                    target = workflow.step(getattr(action.config, "step_id", "") or "")
                if target is not None:
                    edge = (step.id, target.id, trigger.removeprefix("on_"))
                    if edge not in found:
                        found.append(edge)
    return found


def workflow_of(result: Any) -> Workflow | None:
    """The workflow a `get_workflow` result holds (its `workflow`, `template` or `definition` mapping, the
    result itself, or its `yaml` text), or None when none validates as one."""
    if not isinstance(result, dict):
        return None
    for candidate in (result.get("workflow"), result.get("template"), result.get("definition"), result):
        if isinstance(candidate, dict) and "steps" in candidate:
            try:
                return workflow_from_dict(candidate, "get_workflow")
            except (OnceflowError, ValueError):
                continue
    if isinstance(result.get("yaml"), str):
        try:
            return load_workflow_text(result["yaml"], "get_workflow")
        except (OnceflowError, ValueError):
            return None
    return None


def graph_svg(workflow: Workflow) -> str:
    """The SVG document of `workflow`'s graph (width grows with the step count, about 210 px a step)."""
    steps = sorted(workflow.steps, key=lambda s: s.position)
    column = {step.id: i for i, step in enumerate(steps)}
    edges = transitions(workflow)
    width = max(1, len(steps)) * (BOX_W + GAP) + GAP
    span = max((abs(column[a] - column[b]) for a, b, _ in edges), default=1)
    height = TOP + BOX_H + 30 + ARC * span + 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" font-family="sans-serif" font-size="12" role="img">',
        f"<title>{escape(workflow.name or workflow.id)}</title>",
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
    ]

    def x_of(step_id: str) -> float:
        return GAP + column[step_id] * (BOX_W + GAP) + BOX_W / 2

    for source, target, trigger in edges:
        x1, x2 = x_of(source), x_of(target)
        distance = abs(column[source] - column[target])
        forward = column[target] > column[source]
        if forward and distance == 1:
            y = TOP + BOX_H / 2
            path = f"M{x1 + BOX_W / 2:.0f},{y:.0f} L{x2 - BOX_W / 2:.0f},{y:.0f}"
            label_x, label_y = (x1 + x2) / 2, y - 6
        elif forward or source == target:
            lift = 30 + ARC * distance
            y = TOP
            path = f"M{x1:.0f},{y} C{x1:.0f},{y - lift} {x2:.0f},{y - lift} {x2:.0f},{y}"
            label_x, label_y = (x1 + x2) / 2, y - lift * 0.75 - 4
        else:
            drop = 30 + ARC * distance
            y = TOP + BOX_H
            path = f"M{x1:.0f},{y} C{x1:.0f},{y + drop} {x2:.0f},{y + drop} {x2:.0f},{y}"
            label_x, label_y = (x1 + x2) / 2, y + drop * 0.75 + 12
        parts.append(
            f'<path d="{path}" fill="none" stroke="#555" stroke-width="1.5" marker-end="url(#arrow)" '
            f'data-from="{escape(source)}" data-to="{escape(target)}"/>'
            f'<text x="{label_x:.0f}" y="{label_y:.0f}" text-anchor="middle" fill="#333">'
            f"{escape(trigger.replace('_', ' '))}</text>"
        )
    for step in steps:
        x = GAP + column[step.id] * (BOX_W + GAP)
        fill = escape(step.color) if step.color.startswith("#") else "#eef2f7"
        parts.append(
            f'<g data-step="{escape(step.id)}"><rect x="{x}" y="{TOP}" width="{BOX_W}" height="{BOX_H}" '
            f'rx="8" fill="{fill}" stroke="#345"/><text x="{x + BOX_W / 2:.0f}" y="{TOP + 20}" '
            f'text-anchor="middle" font-weight="bold">{escape(step.name[:22])}</text>'
            f'<text x="{x + BOX_W / 2:.0f}" y="{TOP + 37}" text-anchor="middle" fill="#567">'
            f"{escape(step.id[:24])}{' (start)' if step.is_start_step else ''}</text></g>"
        )
    parts.append("</svg>")
    return "".join(parts)
