"""The package installs like any other: from a wheel and from an editable install, a user's own code outside
the checkout imports onceflow, type-checks against it under `mypy --strict` (its types reach the user's code,
not `Any`), and the shipped example runs from that directory.

The wheel is built from a copy of the tracked files (the checkout is never written to) and installed with
no dependencies into a fresh virtual environment that borrows this one's site-packages for them; that
borrowed directory is added by a path file, whose own path files (this checkout's editable install) Python
does not read, so there `onceflow` is the wheel's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from helpers import REPO

USER_CODE = """\
import onceflow
import onceflow.aio
from onceflow.protocol import Reply


async def start(db: str) -> list[str]:
    async with onceflow.open_runtime(db) as rt:
        reply: Reply = (await rt.send({"type": "list_tasks"})).raise_for_error()
        return [event.type for event in reply.events]


async def start_under_asyncio(db: str) -> bool:
    async with onceflow.aio.open_runtime(db) as rt:
        return (await rt.send({"type": "list_tasks"})).ok
"""

# Only a checker that sees onceflow's types finds this: `Reply.ok` is a bool.
WRONG_CODE = """\
from onceflow.protocol import Reply


def count(reply: Reply) -> str:
    return reply.ok
"""
WRONG_FOUND = 'error: Incompatible return value type (got "bool", expected "str")'


def mypy(python: Path, folder: Path) -> subprocess.CompletedProcess[str]:
    """`mypy --strict` of the user's two files in `folder`, resolving imports as `python` does."""
    (folder / "user.py").write_text(USER_CODE)
    (folder / "wrong.py").write_text(WRONG_CODE)
    options = ["--strict", "--python-executable", str(python), "--no-incremental", "--cache-dir", os.devnull]
    return subprocess.run(
        [sys.executable, "-m", "mypy", *options, "user.py", "wrong.py"],
        cwd=folder, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def assert_types_reach_user_code(checked: subprocess.CompletedProcess[str]) -> None:
    lines = [line for line in checked.stdout.splitlines() if ": error:" in line or ": note:" in line]
    assert len(lines) == 1 and lines[0].startswith("wrong.py:5: ") and WRONG_FOUND in lines[0], checked.stdout


def run_example(python: Path, folder: Path) -> None:
    example = subprocess.run(
        [str(python), "-m", "onceflow.examples.agent_host", "--db", str(folder / "board.db")],
        cwd=folder, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert example.returncode == 0, example.stderr[-2000:]


def test_an_editable_install_type_checks_and_runs_from_another_directory(tmp_path: Path) -> None:
    """This checkout is installed editable (README's set-up): the path entry is static, so mypy follows it."""
    origin = subprocess.run(
        [sys.executable, "-c", "import onceflow; print(onceflow.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(origin.stdout.strip()) == REPO / "onceflow" / "__init__.py"
    assert_types_reach_user_code(mypy(Path(sys.executable), tmp_path))
    run_example(Path(sys.executable), tmp_path)


@pytest.mark.skipif(shutil.which("git") is None, reason="the wheel is built from the tracked files")
def test_a_wheel_installs_type_checks_and_runs_from_another_directory(tmp_path: Path) -> None:
    source, wheels, env, user = (tmp_path / name for name in ("source", "wheels", "env", "user"))
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(source)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    (wheel,) = wheels.glob("onceflow-*.whl")
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = Path(subprocess.check_output([python, "-c", where], text=True).strip())
    (purelib / "borrowed-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    user.mkdir()
    origin = subprocess.run(
        [str(python), "-c", "import onceflow; print(onceflow.__file__)"],
        cwd=user, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(origin.stdout.strip()) == purelib / "onceflow" / "__init__.py"
    assert_types_reach_user_code(mypy(python, user))
    run_example(python, user)
