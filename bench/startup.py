"""CLI start-up: `onceflow --help` and `onceflow validate` of a Kandev template against `python -c pass`.

Run: python bench/startup.py [--rounds 5] [--template FILE]

Each command is a whole process of this interpreter (`python -m onceflow.cli ...` is what the `onceflow`
script runs), timed wall-clock from spawn to exit. The commands run interleaved (pass, help, validate,
floor, pass, help, ...), after one warm-up round that is not counted and writes the bytecode caches
(PYTHONDONTWRITEBYTECODE is removed from the children's environment: an installed package has its caches).
Prints each command's median and its ratio to `python -c pass`'s median, and the targets: `--help` <= 5x,
`validate` <= 8x. `floor` is what `validate` costs at least while templates are pydantic models read with
PyYAML: importing both and defining one model (with the collector's passes, which `validate` skips while it
imports: it may come in a little under). Exits 1 when a command fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "tests" / "fixtures" / "kandev" / "office-default.yml"
FLOOR = "import pydantic, yaml\nclass M(pydantic.BaseModel):\n    x: int"


def commands(template: Path) -> dict[str, list[str]]:
    """The timed commands by name."""
    cli = [sys.executable, "-m", "onceflow.cli"]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "onceflow --help": [*cli, "--help"],
        "onceflow validate": [*cli, "validate", str(template)],
        "floor (pydantic + yaml)": [sys.executable, "-c", FLOOR],
    }


def run_once(argv: list[str], env: dict[str, str]) -> float:
    """Seconds from spawn to exit of one run; raises CalledProcessError when it fails."""
    start = time.perf_counter()
    subprocess.run(argv, env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds (medians over them)")
    parser.add_argument("--template", type=Path, default=TEMPLATE, help="the template `validate` reads")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    timed = commands(args.template)
    times: dict[str, list[float]] = {name: [] for name in timed}
    try:
        for round_ in range(args.rounds + 1):
            for name, argv in timed.items():
                seconds = run_once(argv, env)
                if round_:
                    times[name].append(seconds)
    except subprocess.CalledProcessError as exc:
        print(f"FAILED: {' '.join(exc.cmd)} exited {exc.returncode}", file=sys.stderr)
        return 1
    base = statistics.median(times["python -c pass"])
    print(f"{args.rounds} rounds interleaved, load average {os.getloadavg()[0]:.2f}")
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"  {name:<24} median {median * 1000:7.1f} ms  {median / base:5.2f}x"
            f"  (min {min(values) * 1000:.1f})"
        )
    help_ratio = statistics.median(times["onceflow --help"]) / base
    validate_ratio = statistics.median(times["onceflow validate"]) / base
    print(
        f"targets: --help {help_ratio:.2f}x <= 5x: {'met' if help_ratio <= 5 else 'not met'}; "
        f"validate {validate_ratio:.2f}x <= 8x: {'met' if validate_ratio <= 8 else 'not met'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
