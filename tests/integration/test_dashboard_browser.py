"""The dashboard in a real browser: headless Chromium (Debian's ``chromium``, driven by
playwright with ``executable_path``, so no browser is downloaded) on the page a short fleet run
serves. While the run goes, the curves gain points, a replica's weight version advances and
the trainer (and router, reward) is drawn up; a screenshot is saved (the test's tmp dir, and ``docs/dashboard.png`` for the docs). Then a
replica is SIGKILLed: the page marks it down, and up again once ``rlfleet up`` restarted it.

Skipped, saying why, where playwright or a Chromium binary is missing
(``scripts/setup_venv.sh`` installs both where it can: pip, and apt-get as root).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import urllib.request
from pathlib import Path

import pytest
from procs import ROOT, ServiceProcess
from up_proc import replica_pid, up_argv

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
SCREENSHOT = ROOT / "docs" / "dashboard.png"


def chromium_path() -> str | None:
    override = os.environ.get("RLFLEET_CHROMIUM")
    return override or next((p for p in map(shutil.which, BROWSERS) if p), None)


def _why_skip() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (scripts/setup_venv.sh installs it)"
    if chromium_path() is None:
        return (
            "no Chromium binary (apt-get install chromium chromium-driver, as "
            "scripts/setup_venv.sh does when run as root; or set RLFLEET_CHROMIUM)"
        )
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_why_skip() is not None, reason=_why_skip() or ""),
]


def dashboard_url(run_dir: Path) -> str | None:
    """The page's URL once the dashboard answers (``endpoints.json``'s ``dashboard`` entry)."""
    try:
        url = json.loads((run_dir / "endpoints.json").read_text())["dashboard"]["http"]
        with urllib.request.urlopen(url + "healthz", timeout=2) as reply:
            return url if reply.status == 200 else None
    except (OSError, KeyError, ValueError):
        return None


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A run that goes on for as long as the tests look at it (stopped at the end)."""
    tmp = tmp_path_factory.mktemp("dashboard")
    run_dir = tmp / "run"
    extra = ["trainer.test_freq=10", "dashboard.enabled=true", "dashboard.refresh_s=0.5"]
    up = ServiceProcess.start(
        up_argv(run_dir, "hf", 100_000, extra), tmp / "up.log", name="rlfleet up"
    )
    try:
        url = up.wait_until(lambda: dashboard_url(run_dir), 240, "the dashboard")
        yield up, run_dir, url, tmp
    finally:
        up.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=chromium_path(),
            headless=True,
            args=["--no-sandbox", "--disable-dev-shm-usage"],
        )
        yield chromium
        chromium.close()


def reward_points(page) -> int:
    return int(page.get_attribute('svg[data-curve="reward"]', "data-points") or 0)


def replica_version(page, replica_id: str) -> int:
    return int(page.inner_text(f'tr[data-replica="{replica_id}"] td.version'))


def test_curves_grow_and_versions_advance_while_the_run_goes(fleet, browser):
    _, _, url, tmp = fleet
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url)
    page.wait_for_function(
        """() => Number(document.querySelector('svg[data-curve="reward"]').dataset.points) >= 2
              && document.querySelector('tr[data-replica="rollout-0"] td.version')""",
        timeout=240_000,
    )
    points, version = reward_points(page), replica_version(page, "rollout-0")
    page.wait_for_function(
        f"""() => Number(document.querySelector('svg[data-curve="reward"]').dataset.points)
                    > {points}
              && Number(document.querySelector('tr[data-replica="rollout-0"] td.version')
                        .textContent) > {version}""",
        timeout=120_000,
    )  # the page redraws by itself: no reload
    assert reward_points(page) > points and replica_version(page, "rollout-0") > version
    page.wait_for_selector("#legend-reward >> text=held-out", timeout=120_000)  # a validation
    assert page.inner_text("#conn") == "live"
    assert page.locator('tr[data-role="router"].up').count() == 1
    assert page.locator('tr[data-role="reward"].up').count() == 1
    # the trainer is training: its row and the header say so (its health probe's channel
    # must not still back off from the minute it spent loading before it listened)
    assert page.locator('tr[data-role="trainer"].up').count() == 1
    assert page.inner_text("#trainer-state") != "down"
    assert page.locator("#train-samples tbody tr").count() > 0
    shot = tmp / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    shutil.copyfile(shot, SCREENSHOT)
    assert not errors, errors
    page.close()


def test_a_killed_replica_is_marked_down_then_up_after_its_restart(fleet, browser):
    up, run_dir, url, _ = fleet
    page = browser.new_page()
    page.goto(url)
    page.wait_for_selector('tr[data-replica="rollout-1"].up', timeout=120_000)
    os.kill(replica_pid(run_dir, "rollout-1"), signal.SIGKILL)
    page.wait_for_selector('tr[data-replica="rollout-1"].down', timeout=60_000)
    assert "down" in page.inner_text('tr[data-replica="rollout-1"] td.state')
    assert page.locator('tr[data-replica="rollout-0"].up').count() == 1  # the other serves on
    page.wait_for_selector('tr[data-replica="rollout-1"].up', timeout=240_000)  # restarted
    assert "restarting it" in up.log()
    assert page.inner_text("#conn") == "live"
    page.close()
