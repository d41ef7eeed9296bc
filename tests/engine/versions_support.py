"""Kandev's office-default template changed the four ways teams change templates under live tasks: a step
removed, renamed, split in two and merged with the next, each with the `step_map` that migrates its tasks."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import yaml
from helpers import FIXTURES

OFFICE_TEXT = (FIXTURES / "kandev" / "office-default.yml").read_text(encoding="utf-8")

Template = dict[str, Any]


def office() -> Template:
    return copy.deepcopy(yaml.safe_load(OFFICE_TEXT))


def step(template: Template, step_id: str) -> dict[str, Any]:
    return next(s for s in template["steps"] if s["id"] == step_id)


def retarget(template: Template, old: str, new: str) -> None:
    """Every move_to_step to `old` goes to `new` instead."""
    for each in template["steps"]:
        for actions in (each.get("events") or {}).values():
            for action in actions:
                config = action.get("config") or {}
                if action["type"] == "move_to_step" and config.get("step_id") == old:
                    config["step_id"] = new


def removed() -> Template:
    """Review dropped: work moves straight to approval."""
    template = office()
    template["steps"] = [s for s in template["steps"] if s["id"] != "review"]
    retarget(template, "review", "approval")
    return template


def renamed() -> Template:
    """Review renamed peer-review (its id and every move to it)."""
    template = office()
    step(template, "review")["id"] = "peer-review"
    retarget(template, "review", "peer-review")
    return template


def split() -> Template:
    """Review split into review-code then review-design, each a reviewer quorum."""
    template = office()
    review = step(template, "review")
    design = copy.deepcopy(review)
    review["id"], review["name"] = "review-code", "Code review"
    design["id"], design["name"], design["position"] = "review-design", "Design review", 3
    step(template, "approval")["position"], step(template, "done")["position"] = 4, 5
    retarget(template, "review", "review-code")
    forward = review["events"]["on_turn_complete"][0]["config"]
    forward["step_id"] = "review-design"
    template["steps"].insert(template["steps"].index(review) + 1, design)
    return template


def merged() -> Template:
    """Review and approval merged into sign-off: the reviewers' quorum moves the task to done."""
    template = office()
    review = step(template, "review")
    review["id"], review["name"] = "sign-off", "Sign-off"
    review["events"]["on_turn_complete"][0]["config"]["step_id"] = "done"
    template["steps"] = [s for s in template["steps"] if s["id"] != "approval"]
    retarget(template, "review", "sign-off")
    retarget(template, "approval", "sign-off")
    return template


def text(template: Template) -> str:
    return yaml.safe_dump(template, sort_keys=False)


CHANGES: dict[str, tuple[Callable[[], Template], dict[str, str]]] = {
    "removed": (removed, {"review": "approval"}),
    "renamed": (renamed, {"review": "peer-review"}),
    "split": (split, {"review": "review-code"}),
    "merged": (merged, {"review": "sign-off", "approval": "sign-off"}),
}
"""name -> (the changed template, the step_map migrating office-default's tasks onto it)."""
