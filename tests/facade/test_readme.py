"""README's examples stay true: the embedding snippet and the `onceflow run` example run as written,
from any folder, with nothing beside the clone."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from helpers import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def _run_snippet(snippet: str, folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", snippet], cwd=folder, capture_output=True, text=True, timeout=120
    )


def test_readme_embedding_example_runs_from_an_empty_folder(tmp_path: Path) -> None:
    trio_snippet = _blocks("python")[0]
    done = _run_snippet(trio_snippet, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "turn_complete -> run_queued" in done.stdout


def test_issue13_readme_asyncio_example_runs_from_an_empty_folder(tmp_path: Path) -> None:
    """README's asyncio embedding runs as written under asyncio.run, printing only its events."""
    asyncio_snippet = _blocks("python")[1]
    done = _run_snippet(asyncio_snippet, tmp_path)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    assert printed[:3] == ["task_created"] * 3
    assert printed[-1] == "step_entered"


def test_readme_run_example_uses_only_bundled_files(tmp_path: Path) -> None:
    (line,) = [
        line
        for block in _blocks("sh")
        for line in block.splitlines()
        if line.startswith("onceflow run ") and "examples/" in line
    ]
    argv = [*shlex.split(line)[1:], "--db", str(tmp_path / "run.db")]
    done = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "'done'" in done.stdout or '"step_id": "done"' in done.stdout


def test_readme_runs_worker_example_runs_from_an_empty_folder(tmp_path: Path) -> None:
    """README's worker loop claims the developer's run, moves the task to Review and finishes the run."""
    [snippet] = [block for block in _blocks("python") if "rt.runs(" in block]
    done = _run_snippet(snippet, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["developer works on T-1 for work_started", "run 1 finished"]


def test_readme_agent_host_example_reaches_done(tmp_path: Path) -> None:
    (line,) = [
        line
        for block in _blocks("sh")
        for line in block.splitlines()
        if line.startswith("python -m onceflow.examples.")
    ]
    argv = shlex.split(line)[1:]
    done = subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "FEAT-1 is at done"


def test_readme_demo_trace_is_what_the_demo_prints(tmp_path: Path) -> None:
    """The walkthrough's excerpts of the demo's trace (the ```text blocks holding `>` command lines or its
    summary) are lines the demo prints, in that order; its decisions show `decider_type`, which
    `record_decision` requires."""
    excerpts = [block for block in _blocks("text") if "> record_decision" in block or "Summary:" in block]
    assert len(excerpts) == 2
    done = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "demo", "--db", str(tmp_path / "demo.db")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    for excerpt in excerpts:
        shown = excerpt.splitlines()
        starts = [i for i, line in enumerate(printed) if line == shown[0]]
        assert any(printed[i : i + len(shown)] == shown for i in starts), excerpt
    decisions = [line for excerpt in excerpts for line in excerpt.splitlines() if "> record_decision" in line]
    assert decisions and all("decider_type=agent" in line for line in decisions)


def _globbed(word: str) -> list[str]:
    """A shell word with its wildcards expanded from the repository root (itself when it matches none)."""
    matched = sorted(str(path.relative_to(REPO)) for path in REPO.glob(word)) if "*" in word else []
    return matched or [word]


def test_readme_walkthrough_lines_print_what_their_comments_say() -> None:
    """Each `onceflow ...  # ok: ...` line of a ```sh block runs from the repository root and prints that
    on every line (`...` stands for anything)."""
    lines = [
        line
        for block in _blocks("sh")
        for line in block.splitlines()
        if line.startswith("onceflow ") and "# ok:" in line
    ]
    assert len(lines) >= 2
    for line in lines:
        command, _, expected = line.partition("#")
        argv = [found for word in shlex.split(command)[1:] for found in _globbed(word)]  # as a shell would
        done = subprocess.run(
            [sys.executable, "-m", "onceflow.cli", *argv],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (line, done.stderr)
        pattern = ".*".join(re.escape(part) for part in expected.strip().split("..."))
        printed = done.stdout.splitlines()
        assert printed and all(re.fullmatch(pattern, out) for out in printed), (line, done.stdout)
