"""`onceflow test SCENARIO.yml...`: message-level tests of a workflow template. The file format is
`format.py`'s (pure), the runner `runner.py`'s (main thread, one Trio run per scenario)."""

from onceflow.scenario.format import LoadedScenario, ScenarioError, load_scenarios
from onceflow.scenario.runner import ScenarioResult, add_commands, matches, run_files, run_scenario

__all__ = [
    "LoadedScenario",
    "ScenarioError",
    "ScenarioResult",
    "add_commands",
    "load_scenarios",
    "matches",
    "run_files",
    "run_scenario",
]
