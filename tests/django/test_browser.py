"""A real browser (headless Debian Chromium through chromedriver) against the admin on a live server, with a real
prefork Celery worker on the same ledger: an operator pauses a name, the worker stops starting that name's tasks
(other names go on), the operator clears the pause, the waiting tasks run. Screenshots go to /tmp/screens/."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection

from tests.acceptance.conftest import Cluster, make_cluster

SCREENS = Path("/tmp/screens")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="needs Debian's chromium and chromium-driver"),
    pytest.mark.timeout(180),
]


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1440,900", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.implicitly_wait(5)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def cluster(live_server: Any, redis_url: str, tmp_path: Path) -> Iterator[Cluster]:
    """Workers on the Django test database: the admin and the workers share one ledger."""
    db = connection.settings_dict
    url = f"postgresql+psycopg://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    gen = make_cluster(url, redis_url, tmp_path, {"acct": 2})
    c = next(gen)
    try:
        yield c
    finally:
        with c.engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE observed")
        gen.close()


def shoot(driver: Any, name: str) -> None:
    SCREENS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1440, max(700, min(int(height), 1400)))
    driver.save_screenshot(str(SCREENS / f"{name}.png"))
    driver.set_window_size(1440, 900)


def wait_for_text(driver: Any, text: str, timeout: float = 10.0) -> str:
    """The page's source once it contains ``text`` (page_source read during a load can be partial or empty)."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(lambda d: text in d.page_source)
    return str(driver.page_source)


def started(cluster: Cluster, note: str) -> int:
    return int(cluster.scalar("SELECT count(*) FROM observed WHERE kind = 'start' AND note = :n", n=note))


def test_pause_and_resume_a_name_from_the_admin(
    browser: Any, live_server: Any, cluster: Cluster, settings: Any
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from tests.acceptance.proj import make_app

    producer = make_app(cluster.env)
    settings.CELERY_KEYED_CELERY_APP = producer.app  # the admin republishes the promotions its changes make
    User.objects.create_superuser("operator", "ops@example.com", "correct horse")
    cluster.start_worker("w1", concurrency=2)
    try:
        # The worker runs acct tasks before the pause.
        producer.hold.delay("acct:1", 0.05, note="before")
        cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end' AND note = 'before'", 1, timeout=30)

        # Log in and pause acct.
        browser.get(f"{live_server.url}/admin/login/")
        browser.find_element(By.NAME, "username").send_keys("operator")
        browser.find_element(By.NAME, "password").send_keys("correct horse")
        browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        wait_for_text(browser, "Site administration")  # the click returns before the next page has loaded
        browser.get(f"{live_server.url}/admin/celery_keyed_django/override/add/")
        shoot(browser, "override_add")
        browser.find_element(By.NAME, "name").send_keys("acct")
        browser.find_element(By.NAME, "slot_limit").send_keys("0")
        browser.find_element(By.NAME, "reason").send_keys("Upstream API incident INC-42: hold all account syncs")
        browser.find_element(By.NAME, "_save").click()
        assert "name “acct” is now paused" in browser.find_element(By.CSS_SELECTOR, "ul.messagelist").text.lower()
        shoot(browser, "overrides")

        # Paused: the worker parks acct tasks and starts none; another name is unaffected.
        paused = [producer.hold.delay(f"acct:{i}", 0.05, note="paused") for i in range(3)]
        producer.hold.delay("other:1", 0.05, note="other")
        cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end' AND note = 'other'", 1, timeout=30)
        cluster.wait_for("SELECT count(*) FROM keyed_waiting", 3, timeout=30)
        time.sleep(1.5)  # several sweep intervals (0.2 s): still nothing of acct starts
        assert started(cluster, "paused") == 0
        browser.get(f"{live_server.url}/admin/celery_keyed_django/key/?state=paused")
        rows = browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
        assert len(rows) == 3 and all("acct:" in r.text for r in rows)
        browser.get(f"{live_server.url}/admin/celery_keyed_django/key/")
        shoot(browser, "keys_paused")
        browser.get(f"{live_server.url}/admin/celery_keyed_django/waiting/")
        shoot(browser, "waiting")

        # A running claim, and the force-release confirmation (declined): the worker's claim stays.
        # Long enough to outlast the browser's steps below on a loaded machine (its claim is checked after them).
        long = producer.hold.delay("other:2", 15, note="long")
        cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND note = 'long'", 1, timeout=30)
        browser.get(f"{live_server.url}/admin/celery_keyed_django/claim/")
        shoot(browser, "claims")
        browser.find_element(By.CSS_SELECTOR, "input.action-select").click()
        Select(browser.find_element(By.NAME, "action")).select_by_value("force_release_action")
        browser.find_element(By.CSS_SELECTOR, "button[name=index]").click()
        browser.find_element(By.CSS_SELECTOR, "input[value='Yes, force release']")  # waits for the page
        assert "held by a live worker" in browser.find_element(By.CSS_SELECTOR, "p.errornote").text
        shoot(browser, "force_release_confirm")
        browser.find_element(By.LINK_TEXT, "No, take me back").click()
        assert cluster.scalar("SELECT count(*) FROM keyed_claims WHERE task_id = :t", t=long.id) == 1

        # Clear the pause: the waiting tasks run.
        browser.get(f"{live_server.url}/admin/celery_keyed_django/override/")
        browser.find_element(By.LINK_TEXT, "Clear…").click()
        shoot(browser, "override_clear")
        browser.find_element(By.NAME, "reason").send_keys("INC-42 resolved")
        browser.find_element(By.CSS_SELECTOR, "input[type=submit][value='Clear the override']").click()
        assert "cleared" in browser.find_element(By.CSS_SELECTOR, "ul.messagelist").text.lower()
        cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end' AND note = 'paused'", 3, timeout=30)
        assert {r.get(timeout=10) for r in paused} == {"paused"}
        assert long.get(timeout=60) == "long"

        browser.get(f"{live_server.url}/admin/celery_keyed_django/override/add/?name=acct")
        browser.get(f"{live_server.url}/admin/celery_keyed_django/overridelog/")
        page = wait_for_text(browser, "INC-42 resolved")
        assert "operator" in page
        shoot(browser, "audit_trail")
        browser.get(f"{live_server.url}/admin/celery_keyed_django/taskrecord/")
        shoot(browser, "outcomes")
        task_id = paused[0].id
        # the worker books the outcome when its release runs, just after the result is stored
        cluster.wait_for("SELECT outcome FROM keyed_tasks WHERE task_id = :t", "completed", timeout=10, t=task_id)
        browser.get(f"{live_server.url}/admin/celery_keyed_django/taskrecord/explain/?task_id={task_id}")
        assert "Finished: completed" in browser.find_element(By.TAG_NAME, "body").text
        shoot(browser, "explain")
    finally:
        from celery_keyed.publisher import close_publisher

        cluster.stop_all()
        close_publisher(producer.app)
        producer.app.close()


def test_the_overview_fits_1280_px(browser: Any, live_server: Any, ledger_engine: Any) -> None:
    """At 1,280 px (a laptop) the app's landing page — the overview of every name, then its pages grouped — shows
    every column of the names' table without a scroll, a long override reason wrapped in its cell. Screenshot in
    /tmp/screens/overview_1280.png."""
    from selenium.webdriver.common.by import By

    from celery_keyed.ledger import Arrival, Ledger

    ledger = Ledger(ledger_engine, holder="worker-7:31337:beef", lease=60.0)
    message = {"task": "proj.sync", "args": [7, "a longer argument, as real calls have"], "kwargs": {"force": True}}
    for n, key in enumerate(["acct:1", "acct:1", "acct:2", "acct:2", "partner-api:tenant-with-a-long-name", "q:1"]):
        ledger.admit(Arrival(f"task-{n}-{'x' * 24}", key=key, task_name="proj.tasks.sync_account_with_vendor",
                             queue="celery", message=message))
    ledger.set_override("stripe", 0, reason="Upstream incident INC-42: hold every charge until the vendor recovers")
    User.objects.create_superuser("operator", "ops@example.com", "correct horse")
    browser.set_window_size(1280, 900)
    browser.get(f"{live_server.url}/admin/login/")
    browser.find_element(By.NAME, "username").send_keys("operator")
    browser.find_element(By.NAME, "password").send_keys("correct horse")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    wait_for_text(browser, "Site administration")
    browser.get(f"{live_server.url}/admin/celery_keyed_django/")
    wait_for_text(browser, "Limit per key")
    SCREENS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SCREENS / "overview_1280.png"))
    page, window = browser.execute_script(
        "return [document.documentElement.scrollWidth, window.innerWidth]")
    assert page <= window, f"the page is {page} px wide at a window of {window} px"
    table, module = browser.execute_script(
        "const m = document.getElementById('keyed-overview');"
        " return [m.querySelector('table').scrollWidth, m.clientWidth]")
    assert table <= module, f"the names' table is {table} px wide in a module of {module} px"
    rows = browser.find_elements(By.CSS_SELECTOR, "#keyed-overview tbody tr")
    assert [r.find_element(By.TAG_NAME, "th").text for r in rows][:1] == ["acct"]  # the busiest first

    # The live pages, with Django's navigation and filter sidebars open: every column shows, none scrolled off.
    for page, text in (("claim/", "worker-7"), ("waiting/", "acct:1"), ("key/", "acct:2")):
        browser.get(f"{live_server.url}/admin/celery_keyed_django/{page}")
        wait_for_text(browser, text)
        browser.save_screenshot(str(SCREENS / f"{page.strip('/')}_1280.png"))
        table, box = browser.execute_script(
            "const r = document.querySelector('#changelist .results'); return [r.scrollWidth, r.clientWidth]")
        assert table <= box, f"{page}: the list is {table} px wide in {box} px: columns scrolled off"
