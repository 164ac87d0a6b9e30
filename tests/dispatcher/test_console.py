"""The web console in a real browser: headless Chromium (Debian's chromium and chromium-driver)
driven through Selenium logs in with a token, opens every view, watches a domain job's progress,
runs an inference and watches the server's charts move under load; screenshots go to
``HMI_CONSOLE_SHOTS`` (``make console-shots``: docs/console/)."""

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from hmi.client import Client
from hmi.dispatcher.serve import run_in_thread
from tests.helpers.servers import ADMIN, TRAIN, domain_corpus, tiny_server

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# Screenshots go to HMI_CONSOLE_SHOTS when set (`make console-shots`: docs/console/), else to a
# temporary folder: a test run writes nothing into the checkout.
_SHOTS: list[Path] = []


def shots_folder() -> Path:
    if not _SHOTS:
        _SHOTS.append(Path(os.environ.get("HMI_CONSOLE_SHOTS") or tempfile.mkdtemp(prefix="hmi-console-shots-")))
    return _SHOTS[0]
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver "
                                "(apt-get install chromium chromium-driver; .ci/run installs them)")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    server = tiny_server(tmp_path_factory.mktemp("home"), metrics_history_s=0.5)  # the history fills in seconds
    url, stop = run_in_thread(server)
    admin = Client(url, ADMIN)
    out = admin.create_tenant("reviews", ["neg", "pos"], training_data={"train": TRAIN * 2}, epochs=2)
    assert admin.wait_job(out["job"], 300)["state"] == "succeeded"
    admin.infer("reviews", ["a great film", "a dull film"])
    yield {"url": url, "admin": admin, "token": out["token"]}
    stop()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,720"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def texts(browser, css) -> list[str]:
    """The text of every displayed element matching ``css`` (the views refresh every second, so an
    element read mid-refresh is read again)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    for _ in range(20):
        try:
            return [e.text for e in browser.find_elements(By.CSS_SELECTOR, css) if e.is_displayed()]
        except StaleElementReferenceException:
            time.sleep(0.05)
    return []


def wait_for(browser, css, text=None, timeout=30.0) -> list[str]:
    end = time.time() + timeout
    while time.time() < end:
        found = texts(browser, css)
        if found and (text is None or any(text in t for t in found)):
            return [t for t in found if text is None or text in t]
        time.sleep(0.1)
    raise AssertionError(f"{css} with {text!r} did not appear; page: {texts(browser, 'body')}")


def login(browser, url, token):
    from selenium.webdriver.common.by import By

    browser.get(url + "/")
    field = browser.find_element(By.ID, "token")
    field.clear()
    field.send_keys(token)
    browser.find_element(By.ID, "connect").click()


def open_view(browser, name):
    from selenium.webdriver.common.by import By

    browser.find_element(By.CSS_SELECTOR, f'#tabs button[data-view="{name}"]').click()


def shot(browser, name):
    folder = shots_folder()
    folder.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(folder / f"{name}.png"))


def test_the_admin_sees_every_view_follows_a_job_and_runs_an_inference(live, browser):
    from selenium.webdriver.common.by import By

    login(browser, live["url"], ADMIN)
    wait_for(browser, "#who", "admin")
    row = wait_for(browser, "#tenants tbody tr", "reviews")[0]
    assert "ready" in row and "bottleneck" in row
    assert any(t in row for t in ("device", "host", "disk")) and " 2 " in f" {row} "
    shot(browser, "tenants")
    job = live["admin"].create_domain("legal", "root", corpus=domain_corpus(), alpha=0.5, steps=30)["job"]
    open_view(browser, "jobs")
    assert "domain" in wait_for(browser, "#jobs tbody tr", job)[0]
    seen = set()
    end = time.time() + 240
    while time.time() < end and "succeeded" not in seen:
        text = " ".join(t for t in texts(browser, "#jobs tbody tr") if job in t)
        seen.update(w for w in ("further pretraining", "building the branch's PLOT", "succeeded") if w in text)
        if ("further pretraining" in text and " 0%" not in text or "PLOT" in text) and "shot" not in seen:
            seen.add("shot")  # the bar part-way through a stage
            shot(browser, "jobs")
        time.sleep(0.2)
    assert "succeeded" in seen and "further pretraining" in seen, seen
    if "shot" not in seen:
        shot(browser, "jobs")
    open_view(browser, "domains")
    wait_for(browser, "#domains tbody tr", "legal")
    shot(browser, "domains")
    open_view(browser, "try")
    wait_for(browser, "#try-tenant option", "reviews")
    box = browser.find_element(By.ID, "try-input")
    box.clear()
    box.send_keys("a great film\nan awful, boring mess")
    browser.find_element(By.ID, "try-run").click()
    out = wait_for(browser, "#try-output tbody tr")
    assert len(out) == 2 and all(("pos" in r or "neg" in r) for r in out)
    shot(browser, "try")


def polylines(browser, chart) -> dict[str, list[tuple[float, float]]]:
    """The points of each series drawn in a chart, by series name (read in one script: the charts
    are redrawn every second)."""
    lines = browser.execute_script(f"return [...document.querySelectorAll('#{chart} polyline')]"
                                   ".map((p) => [p.dataset.series, p.getAttribute('points')])")
    return {name: [tuple(map(float, p.split(","))) for p in (points or "").split()] for name, points in lines}


def test_the_server_view_charts_requests_latency_plot_hits_residency_and_jobs_live(live, browser):
    import threading

    login(browser, live["url"], ADMIN)
    wait_for(browser, "#who", "admin")
    open_view(browser, "server")
    job = live["admin"].update_tenant("reviews", training_data={"train": TRAIN * 400}, epochs=5)["job"]
    stop = threading.Event()

    def load():
        while not stop.is_set():
            live["admin"].infer("reviews", ["a great film", "a dull film, boring and long"])

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        end, drawn = time.time() + 60, {}
        while time.time() < end:
            drawn = {c: polylines(browser, c) for c in ("chart-rps", "chart-latency", "chart-plot", "chart-tiers",
                                                         "chart-jobs")}
            above_zero = {c: any(y < 170 for pts in series.values() for _, y in pts) for c, series in drawn.items()}
            if all(above_zero.values()) and any("update reviews" in name for name in drawn["chart-jobs"]):
                break  # (the history may already hold the tenant's creation: the update is the live one)
            time.sleep(0.5)
        assert all(above_zero.values()), {c: list(series) for c, series in drawn.items()}
        assert set(drawn["chart-latency"]) == {"p50", "p99"}
        assert any(name.startswith("root ") for name in drawn["chart-plot"])
        assert any("update reviews" in name for name in drawn["chart-jobs"]), list(drawn["chart-jobs"])
        browser.set_window_size(1280, 1000)  # every chart in the picture
        time.sleep(1.5)
        shot(browser, "server")
        browser.set_window_size(1280, 720)
    finally:
        stop.set()
        worker.join(30)
        live["admin"].cancel_job(job)
        live["admin"].wait_job(job, 120)


def test_the_server_view_starts_with_the_servers_own_history_after_a_reload(live, browser):
    """The server samples the charted series on its own (here every 0.5 s; the last hour by
    default every 10 s), so a console opened or reloaded now draws the past at once instead of
    starting empty."""
    import json
    import urllib.request

    for _ in range(4):
        live["admin"].infer("reviews", ["a great film"])
    time.sleep(4)
    with urllib.request.urlopen(live["url"] + "/v1/metrics/history", timeout=30) as r:
        history = json.loads(r.read())
    past = history["samples"]
    assert history["interval_s"] == 0.5 and len(past) >= 6
    assert all(b["t"] > a["t"] for a, b in zip(past, past[1:]))
    assert {m[0] for m in past[-1]["metrics"]} >= {"hmi_http_requests_total", "hmi_adapter_residency_total"}
    for reload in (False, True):
        if reload:
            browser.refresh()
        login(browser, live["url"], ADMIN)
        wait_for(browser, "#who", "admin")
        opened = time.time()
        open_view(browser, "server")
        end, points = time.time() + 10, []
        while time.time() < end and not points:
            points = polylines(browser, "chart-rps").get("requests/s", [])
            time.sleep(0.1)
        # a sample a second since the view opened could not draw this many points
        assert len(points) >= len(past) - 1 > time.time() - opened + 2, (len(points), len(past))


def test_chart_axes_read_plainly_with_zero_tiny_and_large_values(live, browser):
    """A chart whose series are all zero reads 0 to 1 (it read 0 to 1.1e-9); tops are 1, 2 or 5 times
    a power of ten; labels carry no float noise."""
    login(browser, live["url"], ADMIN)
    wait_for(browser, "#who", "admin")
    tops = browser.execute_script("return [0, 3e-10, 0.37, 1, 37, 4100].map(niceMax)")
    assert tops == [1, 5e-10, 0.5, 1, 50, 5000]
    labels = browser.execute_script("return [0, 0.5, 1, 0.1 + 0.2, 2.5e-4, 2500, 25].map(axisLabel)")
    assert labels == ["0", "0.5", "1", "0.3", "3e-4", "2.5k", "25"]
    open_view(browser, "server")
    time.sleep(3)
    ticks = browser.execute_script("return [...document.querySelectorAll('svg text[text-anchor=end]')]"
                                   ".map((t) => t.textContent)")
    assert ticks and not [t for t in ticks if "e-9" in t or "e-10" in t], ticks


def test_a_tenant_token_sees_only_its_own_tenant_and_a_bad_token_is_told(live, browser):
    from selenium.webdriver.common.by import By

    login(browser, live["url"], live["token"])
    wait_for(browser, "#who", "tenant reviews")
    assert not browser.find_element(By.CSS_SELECTOR, '#tabs button[data-view="domains"]').is_displayed()
    rows = wait_for(browser, "#tenants tbody tr", "reviews")
    assert len(rows) == 1
    login(browser, live["url"], "not-a-token")
    wait_for(browser, "#error", "401")
