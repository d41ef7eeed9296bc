"""The board at `/` of `onceflow serve --http`, driven in a real headless Chromium with Selenium: tasks
created and moved through the API appear and move as cards without a reload; a paused agent shows paused.

Needs Debian's `chromium` and `chromium-driver`. Skipped when they are missing, unless
ONCEFLOW_REQUIRE_BROWSER=1 (CI: .ci/run installs them and sets it), then a missing browser fails. With
ONCEFLOW_BOARD_SCREENSHOT=PATH the board is saved there as PNG (CI: docs/board.png).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from http_support import HttpServed, http_serving

CHROMEDRIVER = shutil.which("chromedriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

if not (CHROMEDRIVER and CHROMIUM):
    if os.environ.get("ONCEFLOW_REQUIRE_BROWSER") == "1":
        raise RuntimeError("ONCEFLOW_REQUIRE_BROWSER=1 but chromium or chromedriver is missing")
    pytest.skip("chromium and chromium-driver are not installed", allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def served() -> Iterator[HttpServed]:
    with http_serving() as server:
        yield server


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM or ""
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,900",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER or ""), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def command(served: HttpServed, **body: object) -> dict[str, object]:
    reply = httpx.post(f"{served.url}/v1/commands", json=body, timeout=10).json()
    assert reply["ok"], reply
    return reply


def column_of(browser: webdriver.Chrome, task_id: str) -> str | None:
    """The step of the column holding the task's card, None while there is none."""
    found = browser.execute_script(
        "const c = document.querySelector(`.card[data-task-id='${arguments[0]}']`);"
        "return c ? c.closest('.column').dataset.step : null;",
        task_id,
    )
    return found if isinstance(found, str) else None


def test_cards_follow_the_api_live_and_a_paused_agent_shows_paused(
    served: HttpServed, browser: webdriver.Chrome
) -> None:
    command(served, type="create_task", task_id="before", workflow_id="fixture", step_id="todo", title="Old")
    browser.get(served.url + "/")
    wait = WebDriverWait(browser, 10, poll_frequency=0.05)
    wait.until(lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "true")
    assert column_of(browser, "before") == "todo"
    wait.until(lambda b: b.find_element(By.ID, "status").get_attribute("data-state") == "live")

    command(
        served,
        type="create_task",
        task_id="live-1",
        workflow_id="fixture",
        step_id="todo",
        title="Write the docs",
    )
    wait.until(lambda b: column_of(b, "live-1") == "todo")  # appeared without a reload
    command(served, type="move_task", task_id="live-1", step_id="review")
    wait.until(lambda b: column_of(b, "live-1") == "review")  # moved without a reload
    title = browser.find_element(By.CSS_SELECTOR, ".card[data-task-id='live-1'] .title").text
    assert title == "Write the docs"

    browser.find_element(By.CSS_SELECTOR, ".card[data-task-id='live-1']").click()
    wait.until(lambda b: "todo → review" in b.find_element(By.ID, "history").text)
    browser.find_element(By.ID, "close").click()

    operations = httpx.get(f"{served.url}/openapi.json").json()["paths"]
    if "/v1/commands/pause" in operations:  # flow control's commands
        command(served, type="pause", scope="agent", id="reviewer")
        wait.until(
            lambda b: (
                b.execute_script(
                    "const r = document.querySelector(\"tr[data-agent='reviewer']\");"
                    "return r ? r.dataset.paused : null;"
                )
                == "true"
            )
        )
    shot = os.environ.get("ONCEFLOW_BOARD_SCREENSHOT")
    if shot:
        Path(shot).parent.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(shot)
