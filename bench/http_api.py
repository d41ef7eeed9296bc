"""`onceflow serve --http` against the socket, and the board's first paint.

Run: python bench/http_api.py [-n 4000] [-c 64] [--rounds 3] [--board-tasks 10000] [--no-board]

One server process serves both `--socket` and `--http` on one SQLite file (the same runtime). Per round,
interleaved: `-n` `create_task` commands from `-c` concurrent clients over the socket (one connection each,
one command at a time: send, read the reply), then as many over HTTP (`POST /v1/commands` on `-c` kept-alive
connections, a minimal HTTP/1.1 client as lean as the socket's). Prints commands/s each and HTTP / socket
(target: at least 0.5x), medians over the rounds; and the server process's CPU time per command each way
(from /proc: user + system, its store thread included), steadier than rates on a shared machine.

Board: `--board-tasks` tasks are created (pipelined over the socket), then the board is opened in headless
Chromium (Debian's chromium + chromium-driver): the time from navigation start to its first page of cards
on screen (`data-painted`, target: under 1 s), to every page loaded, the cards in the DOM (bounded: at
most 100 a column) and the page's JS heap once loaded (after a garbage collection: what it keeps).

Checks (exit 1 on a violation): every command's reply is ok.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / "tests" / "fixtures" / "workflows" / "minimal.yml"


def start(folder: Path) -> tuple[subprocess.Popen[bytes], Path, str]:
    sock = folder / "s.sock"
    command = [sys.executable, "-m", "onceflow.cli", "serve", "--db", str(folder / "db.sqlite")]
    command += ["--workflow", str(WORKFLOW), "--socket", str(sock), "--http", "127.0.0.1:0"]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert process.stderr is not None
    url = None
    while True:
        line = process.stderr.readline().decode()
        if not line:
            raise SystemExit(f"server exited: {process.wait()}")
        if line.startswith("serving on http://"):
            url = line.split()[-1]
        elif line.startswith("serving on ") and url is not None:
            return process, sock, url


def create(task_id: str) -> dict[str, Any]:
    return {"type": "create_task", "task_id": task_id, "workflow_id": "fixture", "step_id": "todo"}


async def socket_round(sock: Path, n: int, c: int, prefix: str) -> float:
    async def client(k: int) -> None:
        stream = await trio.open_unix_socket(str(sock))
        buffer = b""
        for i in range(k, n, c):
            await stream.send_all(json.dumps(create(f"{prefix}-{i}")).encode() + b"\n")
            while b"\n" not in buffer:
                buffer += await stream.receive_some(65536)
            line, buffer = buffer.split(b"\n", 1)
            if not json.loads(line)["reply"]["ok"]:
                raise SystemExit(f"socket: refused: {line[:200]!r}")
        await stream.aclose()

    began = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for k in range(c):
            nursery.start_soon(client, k)
    return n / (time.perf_counter() - began)


async def http_round(url: str, n: int, c: int, prefix: str) -> float:
    """`n` POST /v1/commands from `c` kept-alive connections, by a minimal HTTP/1.1 client on Trio sockets
    (as lean as the socket's client above: one write a request, the reply read by its Content-Length)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)

    async def client(k: int) -> None:
        stream = await trio.open_tcp_stream(host, int(port))
        buffer = b""
        for i in range(k, n, c):
            body = json.dumps(create(f"{prefix}-{i}")).encode()
            head = b"POST /v1/commands HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            await stream.send_all(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            while b"\r\n\r\n" not in buffer:
                buffer += await stream.receive_some(65536)
            headers, buffer = buffer.split(b"\r\n\r\n", 1)
            length = int(headers.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            while len(buffer) < length:
                buffer += await stream.receive_some(65536)
            if not headers.startswith(b"HTTP/1.1 200"):
                raise SystemExit(f"http: refused: {headers[:200]!r} {buffer[:200]!r}")
            buffer = buffer[length:]
        await stream.aclose()

    began = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for k in range(c):
            nursery.start_soon(client, k)
    return n / (time.perf_counter() - began)


async def fill(sock: Path, count: int) -> None:
    """Create `count` board tasks over one socket connection, pipelined 500 at a time."""
    stream = await trio.open_unix_socket(str(sock))
    buffer = b""
    for start_at in range(0, count, 500):
        batch = range(start_at, min(count, start_at + 500))
        payload = b"".join(
            json.dumps(
                {
                    **create(f"board-{i:05d}"),
                    "title": f"Task {i}",
                    "step_id": ("todo", "work", "review", "done")[i % 4],
                }
            ).encode()
            + b"\n"
            for i in batch
        )
        await stream.send_all(payload)
        for _ in batch:
            while b"\n" not in buffer:
                buffer += await stream.receive_some(65536)
            line, buffer = buffer.split(b"\n", 1)
            if not json.loads(line)["reply"]["ok"]:
                raise SystemExit(f"fill: refused: {line[:200]!r}")
    await stream.aclose()


def board(url: str) -> dict[str, float]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or ""
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1400,900",
        "--enable-precise-memory-info",
        "--js-flags=--expose-gc",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(
        service=Service(executable_path=shutil.which("chromedriver") or ""), options=options
    )
    try:
        figures: dict[str, list[float]] = {"painted": [], "loaded": []}
        for _ in range(3):
            driver.get("about:blank")
            driver.get(url + "/")
            wait = WebDriverWait(driver, 60, poll_frequency=0.02)
            wait.until(lambda d: d.execute_script("return document.body.dataset.loaded") == "true")
            painted = float(driver.execute_script("return document.body.dataset.painted"))
            loaded = float(driver.execute_script("return performance.now()"))
            figures["painted"].append(painted / 1000)
            figures["loaded"].append(loaded / 1000)
        cards = driver.execute_script("return document.querySelectorAll('.card').length")
        driver.execute_script("window.gc && window.gc()")  # the heap kept, not the pages' garbage
        heap = driver.execute_script("return performance.memory ? performance.memory.usedJSHeapSize : 0")
        return {
            "painted": statistics.median(figures["painted"]),
            "loaded": statistics.median(figures["loaded"]),
            "cards": float(cards),
            "heap_mib": heap / 2**20,
        }
    finally:
        driver.quit()


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system, every thread) process `pid` has used, in seconds (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main_async(args: argparse.Namespace, sock: Path, url: str, pid: int) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {"socket": [], "http": [], "socket_cpu": [], "http_cpu": []}
    for r in range(args.rounds):
        began = cpu_seconds(pid)
        figures["socket"].append(await socket_round(sock, args.n, args.c, f"s{r}"))
        middle = cpu_seconds(pid)
        figures["http"].append(await http_round(url, args.n, args.c, f"h{r}"))
        figures["socket_cpu"].append((middle - began) * 1000 / args.n)
        figures["http_cpu"].append((cpu_seconds(pid) - middle) * 1000 / args.n)
        print(
            f"round {r + 1}: socket {figures['socket'][-1]:,.0f}/s ({figures['socket_cpu'][-1]:.3f} ms CPU "
            f"each), http {figures['http'][-1]:,.0f}/s ({figures['http_cpu'][-1]:.3f} ms CPU each)",
            flush=True,
        )
    return figures


def stop(process: subprocess.Popen[bytes], folder: Path) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=4000)
    parser.add_argument("-c", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--board-tasks", type=int, default=10_000)
    parser.add_argument("--no-board", action="store_true")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="of-bench-http-", dir="/tmp"))
    process, sock, url = start(folder)
    try:
        figures = trio.run(main_async, args, sock, url, process.pid)
    finally:
        stop(process, folder)
    median = {name: statistics.median(values) for name, values in figures.items()}
    ratios = [h / s for h, s in zip(figures["http"], figures["socket"], strict=True)]
    print(f"socket create_task/s, C={args.c}: {median['socket']:,.0f}")
    print(f"HTTP POST /v1/commands create_task/s, C={args.c}: {median['http']:,.0f}")
    print(
        f"HTTP / socket: {median['http'] / median['socket']:.2f}x (target >= 0.5x; per round "
        f"{', '.join(f'{r:.2f}' for r in ratios)})"
    )
    print(
        f"server CPU per command: socket {median['socket_cpu']:.3f} ms, HTTP {median['http_cpu']:.3f} ms "
        f"({median['http_cpu'] / median['socket_cpu']:.2f}x)"
    )
    if args.no_board:
        return
    folder = Path(tempfile.mkdtemp(prefix="of-bench-board-", dir="/tmp"))
    process, sock, url = start(folder)  # a fresh database: the board holds exactly --board-tasks
    try:
        trio.run(fill, sock, args.board_tasks)
        shown = board(url)
    finally:
        stop(process, folder)
    print(f"board, {args.board_tasks:,} tasks:")
    print(f"  first paint {shown['painted']:.3f} s (target < 1 s), all pages {shown['loaded']:.3f} s")
    print(f"  cards in the DOM {shown['cards']:.0f}, JS heap {shown['heap_mib']:.1f} MiB")


if __name__ == "__main__":
    main()
