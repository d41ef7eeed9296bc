"""The strict workflow template loader (kandev-engine-notes.md, Template format)."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import FIXTURES
from hypothesis import given
from hypothesis import strategies as st

from onceflow.protocol.workflow import (
    ALLOWED_ACTIONS,
    IMPORT_ALLOWED_ACTIONS,
    ConfigureSessionConfig,
    EmptyConfig,
    EnsureParticipantSeatConfig,
    MoveConfig,
    QueueRunConfig,
    QueueRunForEachParticipantConfig,
    QuorumGuard,
    RunCodeReviewConfig,
    SetSessionModeConfig,
    Step,
    StepEvents,
    Trigger,
    Workflow,
    WorkflowError,
    load_workflow_file,
    load_workflow_text,
    workflow_from_dict,
)

KANDEV_TEMPLATES = FIXTURES / "kandev"
WORKFLOWS = FIXTURES / "workflows"

Mutation = Callable[[dict[str, Any]], None]


def _base() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((WORKFLOWS / "minimal.yml").read_text(encoding="utf-8"))
    return data


def _set(*path_and_value: Any) -> Mutation:
    """A mutation setting data[p0][p1]...[pn] = value (an index one past a list's end appends)."""
    *path, value = path_and_value

    def mutate(data: dict[str, Any]) -> None:
        node: Any = data
        for key in path[:-1]:
            node = node[key]
        if isinstance(node, list) and path[-1] == len(node):
            node.append(value)
        else:
            node[path[-1]] = value

    return mutate


def _all(*mutations: Mutation) -> Mutation:
    def mutate(data: dict[str, Any]) -> None:
        for each in mutations:
            each(data)

    return mutate


def _delete(key: str) -> Mutation:
    def mutate(data: dict[str, Any]) -> None:
        del data[key]

    return mutate


def _load_error(tmp_path: Path, mutation: Mutation) -> WorkflowError:
    data = _base()
    mutation(data)
    path = tmp_path / "case.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    with pytest.raises(WorkflowError) as caught:
        load_workflow_file(path)
    return caught.value


# --- the real templates ------------------------------------------------------------------------------


def test_the_five_kandev_fixture_templates_are_present() -> None:
    assert sorted(path.name for path in KANDEV_TEMPLATES.glob("*.yml")) == [
        "kanban.yml",
        "office-default-v2.yml",
        "office-default.yml",
        "plan-and-build.yml",
        "routine.yml",
    ]


@pytest.mark.parametrize("path", sorted(KANDEV_TEMPLATES.glob("*.yml")), ids=lambda path: path.name)
def test_kandev_fixture_template_loads(path: Path) -> None:
    workflow = load_workflow_file(path)
    assert workflow.steps
    assert workflow.start_step.is_start_step
    assert [step.position for step in workflow.ordered_steps] == sorted(
        step.position for step in workflow.steps
    )


def test_office_default_review_has_the_two_quorum_guards() -> None:
    workflow = load_workflow_file(KANDEV_TEMPLATES / "office-default.yml")
    review = workflow.step("review")
    assert review.stage_type == "review"
    moves = review.events.actions(Trigger.on_turn_complete)
    assert [action.type for action in moves] == ["move_to_step", "move_to_step"]
    configs = [action.config for action in moves]
    assert all(isinstance(config, MoveConfig) for config in configs)
    assert [(c.step_id, c.guard) for c in configs if isinstance(c, MoveConfig)] == [
        ("approval", QuorumGuard(role="reviewer", threshold="all_approve")),
        ("work", QuorumGuard(role="reviewer", threshold="any_reject")),
    ]
    on_enter = review.events.actions(Trigger.on_enter)
    assert [action.type for action in on_enter] == ["clear_decisions", "queue_run_for_each_participant"]
    assert on_enter[0].config == EmptyConfig()
    assert on_enter[1].config == QueueRunForEachParticipantConfig(role="reviewer", reason="review_started")


def test_office_default_v2_later_revision_keys_and_typed_configs() -> None:
    workflow = load_workflow_file(KANDEV_TEMPLATES / "office-default-v2.yml")
    assert workflow.hidden
    assert workflow.step("done").complete_task_on_enter
    assert workflow.step("work").auto_advance_requires_signal
    review_enter = workflow.step("review").events.actions(Trigger.on_enter)
    assert review_enter[1].config == EnsureParticipantSeatConfig(role="reviewer")
    assert review_enter[2].config == QueueRunForEachParticipantConfig(
        role="reviewer", reason="task_assigned", payload={"stage_type": "review"}
    )
    (on_error,) = workflow.step("work").events.actions(Trigger.on_agent_error)
    assert on_error.config == QueueRunConfig(
        target="workspace.ceo_agent", task_id="this", reason="agent_error"
    )


def test_plan_and_build_plan_mode_and_prompt() -> None:
    plan = load_workflow_file(KANDEV_TEMPLATES / "plan-and-build.yml").step("plan")
    assert [a.type for a in plan.events.actions(Trigger.on_enter)] == ["enable_plan_mode", "auto_start_agent"]
    assert [a.type for a in plan.events.actions(Trigger.on_exit)] == ["disable_plan_mode"]
    assert plan.prompt.startswith("[PLANNING PHASE]")
    assert plan.stage_type == "custom"


def test_kanban_navigation_by_position() -> None:
    workflow = load_workflow_file(KANDEV_TEMPLATES / "kanban.yml")
    assert workflow.start_step.id == "in-progress"
    assert workflow.next_step("in-progress") == workflow.step("review")
    assert workflow.previous_step("in-progress") == workflow.step("backlog")
    assert workflow.previous_step("backlog") is None
    assert workflow.next_step("done") is None
    assert workflow.has_step("review")
    assert not workflow.has_step("nope")
    with pytest.raises(KeyError):
        workflow.step("nope")
    (move,) = workflow.step("review").events.actions(Trigger.on_turn_start)
    assert move.type == "move_to_previous"
    assert move.config == MoveConfig()


# --- accepted shapes ---------------------------------------------------------------------------------


def test_minimal_fixture_if_guard_form() -> None:
    workflow = load_workflow_file(WORKFLOWS / "minimal.yml")
    back = workflow.step("review").events.actions(Trigger.on_turn_complete)[1].config
    assert isinstance(back, MoveConfig)
    assert back.wait_for_quorum is None
    assert back.guard == QuorumGuard(role="reviewer", threshold="any_reject")
    mode = workflow.step("work").events.actions(Trigger.on_enter)[0].config
    assert mode == SetSessionModeConfig(mode="code")


def test_wip_extension_keys_accepted() -> None:
    workflow = load_workflow_file(WORKFLOWS / "wip.yml")
    assert (workflow.step("work").wip_limit, workflow.step("work").pull_from_step_id) == (2, "backlog")
    assert (workflow.step("review").wip_limit, workflow.step("review").pull_from_step_id) == (1, "work")
    assert (workflow.step("done").wip_limit, workflow.step("done").pull_from_step_id) == (0, None)


@pytest.mark.parametrize("stage_type", ["", None])
def test_empty_stage_type_is_custom(stage_type: str | None) -> None:
    data = _base()
    data["steps"][1]["stage_type"] = stage_type
    assert workflow_from_dict(data, "dict").step("work").stage_type == "custom"


def test_fan_out_with_empty_role_loads_it_fails_at_run_time_AC_E3() -> None:
    data = _base()
    data["steps"][2]["events"]["on_enter"][1]["config"] = {"role": ""}
    action = workflow_from_dict(data, "dict").step("review").events.actions(Trigger.on_enter)[1]
    assert action.config == QueueRunForEachParticipantConfig(role="")


def test_n_approve_threshold_and_queue_run_targets_accepted() -> None:
    data = _base()
    data["steps"][2]["events"]["on_turn_complete"][0]["config"]["wait_for_quorum"]["threshold"] = (
        "n_approve:2"
    )
    data["steps"][3]["events"] = {
        "on_comment": [
            {"type": "queue_run", "config": {"target": t}} for t in ("participant_role:reviewer",)
        ],
        "on_heartbeat": [{"type": "queue_run", "config": {"target": "agent_profile_id:p1", "task_id": "t9"}}],
        "on_budget_alert": [{"type": "queue_run"}],
    }
    done = workflow_from_dict(data, "dict").step("done")
    assert done.events.actions(Trigger.on_budget_alert)[0].config == QueueRunConfig()
    assert done.events.actions(Trigger.on_heartbeat)[0].config == QueueRunConfig(
        target="agent_profile_id:p1", task_id="t9"
    )


def test_import_path_allows_run_code_review_and_configure_session() -> None:
    data = _base()
    data["steps"][1]["events"]["on_enter"][1:1] = [
        {"type": "run_code_review", "config": {"agent_profile_id": "reviewer-1"}},
        {"type": "configure_session", "config": {"rules": [{"agent_name": "claude", "operation": "keep"}]}},
    ]
    with pytest.raises(WorkflowError) as caught:
        workflow_from_dict(data, "import.yml")
    assert caught.value.field == "steps[1].events.on_enter[1].type"
    on_enter = (
        workflow_from_dict(data, "import.yml", allowed_actions=IMPORT_ALLOWED_ACTIONS)
        .step("work")
        .events.actions(Trigger.on_enter)
    )
    assert on_enter[1].config == RunCodeReviewConfig(agent_profile_id="reviewer-1")
    config = on_enter[2].config
    assert isinstance(config, ConfigureSessionConfig)
    assert [(rule.agent_name, rule.operation) for rule in config.rules] == [("claude", "keep")]


def test_every_trigger_is_a_step_events_field_and_has_an_allow_list() -> None:
    assert set(StepEvents.model_fields) == set(Trigger)
    assert set(ALLOWED_ACTIONS) == set(Trigger)
    assert set(IMPORT_ALLOWED_ACTIONS) == set(Trigger)


# --- rejected shapes -----------------------------------------------------------------------------------

ON_ENTER = ("steps", 1, "events", "on_enter")
FAN_OUT = ("steps", 2, "events", "on_enter", 1)
TO_DONE = ("steps", 2, "events", "on_turn_complete", 0, "config")
GUARD = (*TO_DONE, "wait_for_quorum")
GUARD_FIELD = "steps[2].events.on_turn_complete[0].config.wait_for_quorum"
MODE_FIELD = "steps[1].events.on_enter[0].config.mode"

# id: (mutation, step id, field from the root, message fragment)
REJECTED: dict[str, tuple[Mutation, str | None, str, str]] = {
    "unknown-top-level-key": (_set("owner", "me"), None, "owner", "unknown key 'owner'"),
    "unknown-step-key": (_set("steps", 1, "colour", "red"), "work", "steps[1].colour", "unknown key"),
    "unknown-trigger": (
        _set("steps", 1, "events", "on_start", []),
        "work",
        "steps[1].events.on_start",
        "unknown key",
    ),
    "unknown-action-key": (
        _set(*FAN_OUT, "when", "now"),
        "review",
        "steps[2].events.on_enter[1].when",
        "unknown key",
    ),
    "unknown-action-config-key": (
        _set(*FAN_OUT, "config", "roles", "reviewer"),
        "review",
        "steps[2].events.on_enter[1].config.roles",
        "unknown key 'roles'",
    ),
    "config-on-a-config-less-action": (
        _set("steps", 2, "events", "on_enter", 0, "config", {"all": True}),
        "review",
        "steps[2].events.on_enter[0].config.all",
        "unknown key",
    ),
    "unknown-guard-key": (_set(*GUARD, "quorum", 2), "review", f"{GUARD_FIELD}.quorum", "unknown key"),
    "move-under-on-enter": (
        _set(*ON_ENTER, 2, {"type": "move_to_next"}),
        "work",
        "steps[1].events.on_enter[2].type",
        "action 'move_to_next' is not allowed for trigger on_enter",
    ),
    "run-code-review-under-on-enter": (
        _set(*ON_ENTER, 2, {"type": "run_code_review"}),
        "work",
        "steps[1].events.on_enter[2].type",
        "not allowed for trigger on_enter",
    ),
    "configure-session-under-on-enter": (
        _set(*ON_ENTER, 2, {"type": "configure_session", "config": {"rules": []}}),
        "work",
        "steps[1].events.on_enter[2].type",
        "not allowed for trigger on_enter",
    ),
    "disable-plan-mode-under-on-enter": (
        _set(*ON_ENTER, 2, {"type": "disable_plan_mode"}),
        "work",
        "steps[1].events.on_enter[2].type",
        "not allowed",
    ),
    "queue-run-on-turn-start": (
        _set("steps", 0, "events", {"on_turn_start": [{"type": "queue_run"}]}),
        "todo",
        "steps[0].events.on_turn_start[0].type",
        "not allowed for trigger on_turn_start",
    ),
    "move-under-event-trigger": (
        _set("steps", 0, "events", {"on_comment": [{"type": "move_to_next"}]}),
        "todo",
        "steps[0].events.on_comment[0].type",
        "not allowed for trigger on_comment",
    ),
    "unknown-action-type": (
        _set(*ON_ENTER, 2, {"type": "launch_rockets"}),
        "work",
        "steps[1].events.on_enter[2].type",
        "unknown action type 'launch_rockets'",
    ),
    "action-without-type": (
        _set(*ON_ENTER, 2, {"config": {}}),
        "work",
        "steps[1].events.on_enter[2].type",
        "required",
    ),
    "mode-no-config": (_set(*ON_ENTER, 0, {"type": "set_session_mode"}), "work", MODE_FIELD, "required"),
    "mode-missing": (_set(*ON_ENTER, 0, "config", {}), "work", MODE_FIELD, "required"),
    "mode-empty": (_set(*ON_ENTER, 0, "config", "mode", ""), "work", MODE_FIELD, "at least 1"),
    "mode-int": (_set(*ON_ENTER, 0, "config", "mode", 5), "work", MODE_FIELD, "valid string"),
    "mode-null": (_set(*ON_ENTER, 0, "config", "mode", None), "work", MODE_FIELD, "valid string"),
    "bad-stage-type": (_set("steps", 1, "stage_type", "qa"), "work", "steps[1].stage_type", "'qa'"),
    "two-start-steps": (
        _set("steps", 3, "is_start_step", True),
        "done",
        "steps[3].is_start_step",
        "step 'work' is already the start step",
    ),
    "no-start-step": (_set("steps", 1, "is_start_step", False), None, "steps", "no start step"),
    "duplicate-position": (_set("steps", 3, "position", 2), "done", "steps[3].position", "position 2"),
    "duplicate-step-id": (_set("steps", 3, "id", "work"), "work", "steps[3].id", "duplicate step id 'work'"),
    "dangling-move-target": (
        _set(*TO_DONE, "step_id", "shipped"),
        "review",
        "steps[2].events.on_turn_complete[0].config.step_id",
        "'shipped' is not a step",
    ),
    "move-to-step-without-target": (
        _set(*TO_DONE, {}),
        "review",
        "steps[2].events.on_turn_complete[0].config.step_id",
        "needs a non-empty step_id",
    ),
    "move-to-next-with-target": (
        _set("steps", 1, "events", "on_turn_complete", 0, "config", {"step_id": "review"}),
        "work",
        "steps[1].events.on_turn_complete[0].config.step_id",
        "move_to_next takes no step_id",
    ),
    "guard-without-threshold": (
        _set(*GUARD, {"role": "reviewer"}),
        "review",
        f"{GUARD_FIELD}.threshold",
        "required",
    ),
    "guard-without-role": (
        _set(*GUARD, {"threshold": "all_approve"}),
        "review",
        f"{GUARD_FIELD}.role",
        "required",
    ),
    "two-guards": (
        _set(*TO_DONE, "if", {"wait_for_quorum": {"role": "reviewer", "threshold": "all_decide"}}),
        "review",
        "steps[2].events.on_turn_complete[0].config.if",
        "not both",
    ),
    "if-without-wait-for-quorum": (
        _set(*TO_DONE, "if", {"role": "reviewer"}),
        "review",
        "steps[2].events.on_turn_complete[0].config.if.wait_for_quorum",
        "required",
    ),
    "pull-from-itself": (
        _set("steps", 2, "pull_from_step_id", "review"),
        "review",
        "steps[2].pull_from_step_id",
        "cannot pull from itself",
    ),
    "pull-from-unknown-step": (
        _set("steps", 2, "pull_from_step_id", "elsewhere"),
        "review",
        "steps[2].pull_from_step_id",
        "'elsewhere' is not a step",
    ),
    "pull-from-cycle": (
        _all(_set("steps", 1, "pull_from_step_id", "review"), _set("steps", 2, "pull_from_step_id", "work")),
        "work",
        "steps[1].pull_from_step_id",
        "cycle: work -> review -> work",
    ),
    "bad-queue-run-target": (
        _set("steps", 3, "events", {"on_comment": [{"type": "queue_run", "config": {"target": "everyone"}}]}),
        "done",
        "steps[3].events.on_comment[0].config.target",
        "'everyone'",
    ),
    "empty-target-role": (
        _set(
            "steps",
            3,
            "events",
            {"on_comment": [{"type": "queue_run", "config": {"target": "participant_role:"}}]},
        ),
        "done",
        "steps[3].events.on_comment[0].config.target",
        "participant_role:<role>",
    ),
    "position-str": (_set("steps", 1, "position", "1"), "work", "steps[1].position", "valid integer"),
    "wip-str": (_set("steps", 1, "wip_limit", "2"), "work", "steps[1].wip_limit", "valid integer"),
    "bool-str": (
        _set("steps", 1, "allow_manual_move", "yes"),
        "work",
        "steps[1].allow_manual_move",
        "boolean",
    ),
    "step-not-a-mapping": (_set("steps", 1, "work"), None, "steps[1]", "valid dictionary"),
    "no-steps-key": (_delete("steps"), None, "steps", "required"),
}


@pytest.mark.parametrize(
    ("mutation", "step_id", "field", "fragment"), list(REJECTED.values()), ids=list(REJECTED)
)
def test_rejected(tmp_path: Path, mutation: Mutation, step_id: str | None, field: str, fragment: str) -> None:
    error = _load_error(tmp_path, mutation)
    assert (error.step_id, error.field) == (step_id, field)
    assert error.source == str(tmp_path / "case.yml")
    assert fragment in error.message
    rendered = str(error)
    assert "case.yml" in rendered
    assert fragment in rendered
    if step_id is not None:
        relative = field.split(".", 1)[1] if "." in field else ""
        assert f"step {step_id!r}: field {relative!r}: " in rendered


@pytest.mark.parametrize(
    "threshold", ["n_approve:0", "n_approve:x", "most", "n_approve:-1", "n_approve:", ""]
)
def test_bad_threshold(tmp_path: Path, threshold: str) -> None:
    error = _load_error(tmp_path, _set(*GUARD, "threshold", threshold))
    assert (error.step_id, error.field) == ("review", f"{GUARD_FIELD}.threshold")
    assert f"threshold {threshold!r} is not" in str(error)
    assert "case.yml" in str(error)


def test_error_message_shape() -> None:
    data = _base()
    data["steps"][2]["events"]["on_enter"].append({"type": "move_to_next"})
    with pytest.raises(WorkflowError) as caught:
        workflow_from_dict(data, "office.yml")
    assert str(caught.value) == (
        "office.yml: step 'review': field 'events.on_enter[2].type': "
        "action 'move_to_next' is not allowed for trigger on_enter"
    )


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("id: x\nsteps: [\n", "not valid YAML"),
        ("id: x\nname: a\nid: y\n", "duplicate key 'id' (line 3, column 1)"),
        ("- id: x\n", "must be a mapping, not list"),
        ("just text\n", "must be a mapping, not str"),
        ("", "must be a mapping, not NoneType"),
    ],
)
def test_document_level_errors(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "doc.yml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(WorkflowError) as caught:
        load_workflow_file(path)
    assert (caught.value.step_id, caught.value.field) == (None, "")
    assert fragment in str(caught.value)
    assert "doc.yml" in str(caught.value)


def test_load_workflow_text_default_source() -> None:
    with pytest.raises(WorkflowError) as caught:
        load_workflow_text("[]")
    assert str(caught.value).startswith("<string>: ")


# --- property: any unknown key is rejected, naming it --------------------------------------------------

_KEY = st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True)


@given(key=_KEY.filter(lambda key: key not in Workflow.model_fields))
def test_any_unknown_top_level_key_is_named(key: str) -> None:
    data = _base()
    data[key] = 1
    with pytest.raises(WorkflowError) as caught:
        workflow_from_dict(data, "prop.yml")
    assert (caught.value.step_id, caught.value.field) == (None, key)
    assert f"unknown key {key!r}" in str(caught.value)


@given(key=_KEY.filter(lambda key: key not in Step.model_fields), index=st.integers(0, 3))
def test_any_unknown_step_key_is_named(key: str, index: int) -> None:
    data = _base()
    data["steps"][index][key] = True
    with pytest.raises(WorkflowError) as caught:
        workflow_from_dict(data, "prop.yml")
    assert caught.value.step_id == data["steps"][index]["id"]
    assert caught.value.field == f"steps[{index}].{key}"
    assert f"unknown key {key!r}" in str(caught.value)


@given(key=_KEY.filter(lambda key: key not in QueueRunForEachParticipantConfig.model_fields))
def test_any_unknown_action_config_key_is_named(key: str) -> None:
    data = _base()
    data["steps"][2]["events"]["on_enter"][1]["config"][key] = "x"
    with pytest.raises(WorkflowError) as caught:
        workflow_from_dict(data, "prop.yml")
    assert caught.value.field == f"steps[2].events.on_enter[1].config.{key}"
    assert f"unknown key {key!r}" in str(caught.value)


# --- every problem at once, with the closest known name ---------------------------


def test_every_field_error_of_a_template_is_reported_not_only_the_first() -> None:
    data = _base()
    data["stpes"] = data.pop("steps")
    with pytest.raises(WorkflowError) as caught:
        workflow_from_dict(data, "t.yml")
    assert [(e.field, e.message) for e in (caught.value, *caught.value.others)] == [
        ("steps", "required key is missing"),
        ("stpes", "unknown key 'stpes' (did you mean 'steps'?)"),
    ]

    data = _base()
    data["steps"][0]["colr"] = "red"
    data["steps"][1]["events"]["on_entr"] = []
    data["steps"][2]["events"]["on_enter"][0]["type"] = "clear_decisons"
    data["steps"][2]["events"]["on_enter"][1]["config"]["rol"] = "reviewer"
    data["steps"][3]["position"] = "3"
    with pytest.raises(WorkflowError) as caught:
        workflow_from_dict(data, "t.yml")
    found = [(e.step_id, e.field, e.message) for e in (caught.value, *caught.value.others)]
    assert found == [
        ("todo", "steps[0].colr", "unknown key 'colr' (did you mean 'color'?)"),
        ("work", "steps[1].events.on_entr", "unknown key 'on_entr' (did you mean 'on_enter'?)"),
        (
            "review",
            "steps[2].events.on_enter[0].type",
            "unknown action type 'clear_decisons' (did you mean 'clear_decisions'?)",
        ),
        (
            "review",
            "steps[2].events.on_enter[1].config.rol",
            "unknown key 'rol' (did you mean 'role'?)",
        ),
        ("done", "steps[3].position", "Input should be a valid integer (got '3')"),
    ]
    assert str(caught.value) == "t.yml: step 'todo': field 'colr': unknown key 'colr' (did you mean 'color'?)"


def test_an_unknown_key_with_no_close_name_gets_no_suggestion() -> None:
    data = _base()
    data["zzzzzz"] = 1
    with pytest.raises(WorkflowError) as caught:
        workflow_from_dict(data, "t.yml")
    assert caught.value.message == "unknown key 'zzzzzz'"
    assert caught.value.others == ()
