"""docs/templates.md stays true: every example in it is run, and its reference tables are the loader's.

Fences are the contract: a ```yaml block is a template that must load (and validate against the JSON
Schema an editor uses); a ```yaml scenario block is an `onceflow test` scenario, run against the template
before it; a ```yaml invalid block must be refused with exactly the `onceflow validate` output of the
```text block after it; each `onceflow ...  # output` line of a ```sh block is run in the folder the
examples are saved in and must print that output (`...` stands for anything); each line of a ```json
block is a command the protocol accepts.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from helpers import REPO

from onceflow.protocol import limits
from onceflow.protocol.codec import decode_command, parse_json
from onceflow.protocol.template.schema import template_schema
from onceflow.protocol.workflow import (
    ALLOWED_ACTIONS,
    CONFIG_MODELS,
    Step,
    Trigger,
    Workflow,
    WorkflowError,
    load_workflow_text,
)
from onceflow.scenario import load_scenarios
from onceflow.scenario.runner import run_scenario

GUIDE = REPO / "docs" / "templates.md"
TEXT = GUIDE.read_text(encoding="utf-8")
BLOCKS: list[tuple[str, str]] = re.findall(r"^```([^\n]*)\n(.*?)^```$", TEXT, flags=re.DOTALL | re.MULTILINE)


def blocks(info: str) -> list[str]:
    return [body for fence, body in BLOCKS if fence == info]


def templates() -> list[str]:
    return blocks("yaml")


def onceflow(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onceflow.cli", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )


def saved_examples(folder: Path) -> None:
    """The guide's files, saved under the names it gives them: the worked example's template (the last
    ```yaml block before the scenario), its scenario, and the invalid template."""
    fences = [fence for fence, _ in BLOCKS]
    scenario_at = fences.index("yaml scenario")
    template = next(body for fence, body in reversed(BLOCKS[:scenario_at]) if fence == "yaml")
    scenario = BLOCKS[scenario_at][1]
    (folder / str(yaml.safe_load(scenario)["template"])).write_text(template, encoding="utf-8")
    (folder / "content-pipeline.test.yml").write_text(scenario, encoding="utf-8")
    (folder / "broken.yml").write_text(blocks("yaml invalid")[0], encoding="utf-8")


def test_the_guide_has_its_examples() -> None:
    assert len(templates()) >= 2
    assert len(blocks("yaml scenario")) == 1 and len(blocks("yaml invalid")) == 1
    assert {fence for fence, _ in BLOCKS} <= {
        "yaml",
        "yaml scenario",
        "yaml invalid",
        "text",
        "sh",
        "json",
        "",
    }


@pytest.mark.parametrize("index", range(len(templates())))
def test_every_yaml_block_is_a_template_the_loader_and_the_editor_schema_accept(index: int) -> None:
    text = templates()[index]
    workflow = load_workflow_text(text, f"docs/templates.md yaml block {index}")
    assert workflow.steps
    jsonschema.Draft7Validator(template_schema()).validate(yaml.safe_load(text))


def test_the_worked_example_scenario_passes(tmp_path: Path) -> None:
    saved_examples(tmp_path)
    (scenario,) = load_scenarios(tmp_path / "content-pipeline.test.yml")
    result = run_scenario(scenario)
    assert result.failure is None, result.failure
    assert result.steps >= 10


def test_the_invalid_example_is_refused_as_the_guide_shows(tmp_path: Path) -> None:
    text = blocks("yaml invalid")[0]
    with pytest.raises(WorkflowError):
        load_workflow_text(text, "broken.yml")
    shown = TEXT.split("```yaml invalid\n", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    saved_examples(tmp_path)
    done = onceflow(tmp_path, "validate", "broken.yml")
    assert done.returncode == 1
    assert done.stdout + done.stderr == shown


def test_every_onceflow_line_of_a_sh_block_prints_what_the_guide_says(tmp_path: Path) -> None:
    saved_examples(tmp_path)
    lines = [line for body in blocks("sh") for line in body.splitlines() if line.startswith("onceflow ")]
    assert len(lines) >= 2
    for line in lines:
        command, _, expected = line.partition("#")
        done = onceflow(tmp_path, *shlex.split(command)[1:])
        assert done.returncode == 0, (line, done.stderr)
        pattern = ".*".join(re.escape(part) for part in expected.strip().split("..."))
        assert re.fullmatch(pattern, done.stdout.strip()), (line, done.stdout)


def test_every_json_line_is_a_command_the_protocol_accepts() -> None:
    lines = [line for body in blocks("json") for line in body.splitlines() if line.strip()]
    assert lines
    for line in lines:
        decode_command(parse_json(line))


def table(heading_row: str) -> dict[str, str]:
    """The first column -> the last column of the Markdown table whose header row starts `heading_row`."""
    rows = TEXT.split(heading_row, 1)[1].split("\n\n", 1)[0].splitlines()[2:]  # past the header and ---
    cells = [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]
    return {first.strip("`"): last for first, *_, last in cells}


def test_the_trigger_table_is_the_loaders_allow_list() -> None:
    rows = table("| trigger | fires when | allowed action types |")
    assert list(rows) == [trigger.value for trigger in Trigger]
    for trigger in Trigger:
        named = set(re.findall(r"`(\w+)`", rows[trigger.value]))
        assert named == ALLOWED_ACTIONS[trigger], trigger


def test_every_key_and_action_type_is_explained() -> None:
    actions = table("| type | kind | config | what it does |")
    assert set(actions) == set(CONFIG_MODELS)
    for key in (*Workflow.model_fields, *Step.model_fields):
        assert f"`{key}`" in TEXT, key
    for model in set(CONFIG_MODELS.values()):
        for key in model.model_fields:
            assert f"`{key.removesuffix('_')}`" in TEXT, (model.__name__, key)
    thresholds = table("| threshold | passes when |")
    assert set(thresholds) == {"all_approve", "all_decide", "majority_approve", "n_approve:N", "any_reject"}


def test_the_limits_table_states_the_loaders_limits() -> None:
    rows = table("| limit | value |")
    stated = dict(re.findall(r"`(MAX_\w+)` = ([\d,]+)", "\n".join(rows.values())))
    assert stated, rows
    for name, value in stated.items():
        assert int(value.replace(",", "")) == getattr(limits, name), name
    assert set(stated) >= {
        "MAX_TEMPLATE_BYTES",
        "MAX_TEMPLATE_STEPS",
        "MAX_TEMPLATE_ACTIONS",
        "MAX_PAYLOAD_BYTES",
    }
