"""README's and docs/'s examples stay true: the embedding snippets and the `onceflow run` example run as
written, from any folder, with nothing beside the clone; README stays short and links every page of docs/."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from helpers import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")
DOCS = sorted((REPO / "docs").glob("*.md"))
GUIDES = README + "".join(page.read_text(encoding="utf-8") for page in DOCS if page.name != "protocol.md")


def _blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def _snippet(marker: str) -> str:
    """The one python block of README or docs/ holding `marker`."""
    [block] = [block for block in _blocks("python", GUIDES) if marker in block]
    return block


def _run_snippet(snippet: str, folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", snippet], cwd=folder, capture_output=True, text=True, timeout=120
    )


def test_readme_embedding_example_runs_from_an_empty_folder(tmp_path: Path) -> None:
    [short] = [block for block in _blocks("python") if "raise_for_error" in block]
    done = _run_snippet(short, tmp_path)
    assert done.returncode == 0, done.stderr
    [turn] = [line for line in done.stdout.splitlines() if line.startswith("turn_complete -> ")]
    assert "step_entered" in turn and "run_queued" in turn


def test_the_full_trio_embedding_example_runs_from_an_empty_folder(tmp_path: Path) -> None:
    done = _run_snippet(_snippet("onceflow.RecordingHost()"), tmp_path)
    assert done.returncode == 0, done.stderr
    assert "turn_complete -> run_queued" in done.stdout


def test_the_logging_example_writes_json_records(tmp_path: Path) -> None:
    snippet = _snippet("onceflow.observability.logs.formatter(json=True)")
    program = snippet + (  # the snippet configures logging; a runtime opened after it logs through it
        "\nimport trio\n\nasync def _open() -> None:\n"
        f"    async with onceflow.open_runtime({str(tmp_path / 'b.db')!r}):\n"
        "        pass\n\ntrio.run(_open)\n"
    )
    done = _run_snippet(program, tmp_path)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines()]
    assert any(r["event"] == "store_opened" and r["logger"] == "onceflow.store.writer" for r in records)


def test_the_asyncio_embedding_example_runs_from_an_empty_folder(tmp_path: Path) -> None:
    """The asyncio embedding runs as written under asyncio.run, printing only its events."""
    asyncio_snippet = _snippet("onceflow.aio.open_runtime(db)")
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
    snippet = _snippet("async with rt.runs(")
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


def test_readme_is_short_and_links_every_page_of_docs() -> None:
    """A newcomer's page: at most 300 lines, and every docs/ page is reachable from it."""
    assert len(README.splitlines()) <= 300
    linked = set(re.findall(r"\]\((docs/[^)#]+)", README))
    assert {f"docs/{page.name}" for page in DOCS} <= linked


def test_every_relative_link_of_readme_and_docs_names_a_file_that_exists() -> None:
    for page in [REPO / "README.md", *DOCS]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), (page.name, target)


def test_readme_template_validates_and_runs_a_task_to_done(tmp_path: Path) -> None:
    """The template a newcomer copies loads, and drives a task Fix -> Review -> Done as the README says."""
    [template] = [block for block in _blocks("yaml") if block.startswith("id: ")]
    (tmp_path / "bugfix.yml").write_text(template, encoding="utf-8")
    program = f"""
import trio, onceflow

async def main() -> None:
    async with onceflow.open_runtime({str(tmp_path / "b.db")!r}) as rt:
        for command in (
            {{"type": "register_workflow", "yaml": open({str(tmp_path / "bugfix.yml")!r}).read()}},
            {{"type": "add_participant", "workflow_id": "bugfix", "step_id": "review", "role": "reviewer",
              "agent_profile_id": "rev-1"}},
            {{"type": "create_task", "task_id": "B-1", "workflow_id": "bugfix", "step_id": "todo",
              "primary_agent_id": "dev"}},
            {{"type": "move_task", "task_id": "B-1", "step_id": "fix"}},
            {{"type": "turn_complete", "task_id": "B-1"}},
            {{"type": "record_decision", "task_id": "B-1", "step_id": "review", "decider_type": "agent",
              "decider_id": "rev-1", "decision": "approved"}},
            {{"type": "get_task", "task_id": "B-1"}},
        ):
            reply = (await rt.send(command)).raise_for_error()
        print(reply.result["step_id"])

trio.run(main)
"""
    checked = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "validate", "bugfix.yml"], cwd=tmp_path,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert checked.returncode == 0 and checked.stdout.startswith("ok: bugfix.yml: bugfix (4 steps)")
    done = _run_snippet(program, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["done"]


def test_the_glossary_defines_the_terms_the_readme_uses() -> None:
    glossary = (REPO / "docs" / "glossary.md").read_text(encoding="utf-8")
    defined = {term.lower() for term in re.findall(r"^\*\*([^*]+)\.\*\*", glossary, flags=re.MULTILINE)}
    used = ("Kandev", "Gas City", "Entry path (E1-E5)", "Epoch", "Fencing token (claim token)", "Run")
    used += ("Lease", "Step entry, entry_seq", "Host", "Template (workflow)", "Quorum", "Participant (seat)")
    for term in used:
        assert term.lower() in defined, term
