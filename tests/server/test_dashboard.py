"""The dashboard: its JSON routes through FastAPI's test client, and the page itself in headless Chromium.

The store these tests serve is filled by the fixture below with SYNTHETIC timings (made-up medians on real
schedules of examples/adam.py): they test the plumbing, they are not measurements. The screenshot in
docs/dashboard.png comes from a real tuned store: see ``test_screenshot``.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from coconet.loader import load_file
from coconet.schedules.schedule import sharded_by
from coconet.schedules.space import generate
from coconet.server.dashboard import PREFIX, mount
from coconet.server.records import NewMeasurement, Progress
from coconet.server.store import Store

ROOT = Path(__file__).resolve().parents[2]
SIZES = [{"N": 1 << 10}, {"N": 1 << 12}, {"N": 1 << 14}]
SCREENSHOT = ROOT / "docs" / "dashboard.png"


def _app(store: Store | None) -> FastAPI:
    app = FastAPI()
    if store is not None:
        app.state.store = store
    mount(app)
    return app


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A store with adam tuned on "local" (jobs, trials, a failure, winners) and a model-predicted topology."""
    url = f"sqlite:///{tmp_path_factory.mktemp('dash') / 'store.db'}"
    program = load_file(ROOT / "examples" / "adam.py")
    schedules = list(generate(program))[:4]
    store = Store.open(url)
    h = store.add_program(program)
    for i, sizes in enumerate(SIZES):
        job = store.create_job(h, sizes, "local", 2, budget=5, backends=["gloo"])
        store.claim_job(job)
        ids = []
        for k, s in enumerate(schedules):
            median = 1e-4 * (1 + i) * (1.0 - 0.15 * k)  # synthetic: later schedules faster
            ids.append(store.add_measurement(NewMeasurement.of(
                s, sizes=sizes, topology="local", world=2, backend="gloo", samples=[median] * 5, n=5,
                median_s=median, ci_lo_s=median * 0.97, ci_hi_s=median * 1.03, job_id=job)))
        store.add_measurement(NewMeasurement.of(
            schedules[1], sizes=sizes, topology="local", world=2, backend="shm", status="runtime_error",
            error="synthetic failure", job_id=job))
        store.add_winner(ids[-1], runner_up_id=ids[-2], baseline_id=ids[0], job_id=job)
        store.update_job(job, state="done", progress=Progress(done=5, total=5, failed=1))
        # A model's prediction of another topology: a winner without a job.
        base, best = (store.add_measurement(NewMeasurement.of(
            s, sizes=sizes, topology="dgx2", world=16, backend="nccl", median_s=t, source="model"))
            for s, t in ((schedules[0], 2e-4), (schedules[2], 1e-4)))
        store.add_winner(best, baseline_id=base)
    try:
        yield {"store": store, "url": url, "hash": h, "schedules": [s.text for s in schedules]}
    finally:
        store.close()


@pytest.fixture(scope="module")
def client(filled: dict[str, Any]) -> TestClient:
    return TestClient(_app(filled["store"]))


def test_assets_are_served_locally(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "/static/plotly.min.js" in page.text and "cdn" not in page.text.lower()
    js = client.get("/static/plotly.min.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert len(js.content) > 1_000_000
    assert client.get("/static/dashboard.js").status_code == 200
    assert client.get("/static/dashboard.css").status_code == 200
    assert client.get("/static/../store.py").status_code == 404
    assert client.get("/static/nothing.js").status_code == 404


def test_program_view(client: TestClient, filled: dict[str, Any]) -> None:
    programs = client.get(f"{PREFIX}/programs").json()
    assert [(p["hash"], p["name"], p["results"]) for p in programs] == [(filled["hash"], "adam", 6)]
    view = client.get(f"{PREFIX}/programs/{filled['hash']}").json()
    schedules = filled["schedules"]
    assert {r["context"] for r in view["results"]} == {"local · 2 ranks · gloo", "dgx2 · 16 ranks · nccl"}
    local = [r for r in view["results"] if r["topology"] == "local"]
    assert [r["sizes"] for r in local] == SIZES
    assert all(r["schedule"] == schedules[-1] and r["speedup"] == pytest.approx(1 / 0.55) for r in local)
    assert all(r["sharded"] == sharded_by(r["schedule"]) for r in view["results"])
    assert all(r["shardable"] == "*" and r["shardable_words"] == "any state" for r in view["results"])
    timing = {t["context"]: t for t in view["timings"]}
    # the baseline, the winner, then the fastest others; the failed shm trial draws no line
    assert [s["name"] for s in timing["local · 2 ranks"]["series"]] == [
        f"gloo: {s}" for s in (schedules[0], schedules[-1], schedules[2], schedules[1])]
    assert all(s["x"] == [1 << 10, 1 << 12, 1 << 14] for s in timing["local · 2 ranks"]["series"])
    assert sorted(s["context"] for s in view["speedups"]) == ["dgx2 · 16 ranks · nccl", "local · 2 ranks · gloo"]
    assert [s["sizes"] for s in view["studies"]] == SIZES[::-1]
    trials = view["studies"][0]["trials"]
    assert [t["status"] for t in trials] == ["ok"] * 4 + ["runtime_error"]


def test_code_and_errors(client: TestClient, filled: dict[str, Any]) -> None:
    view = client.get(f"{PREFIX}/programs/{filled['hash']}").json()
    mid = view["results"][0]["measurement_id"]
    code = client.get(f"{PREFIX}/programs/{filled['hash']}/code", params={"measurement": mid})
    assert code.status_code == 200 and "def step(" in code.text
    assert client.get(f"{PREFIX}/programs/{filled['hash']}/code", params={"measurement": 10_000}).status_code == 404
    assert client.get(f"{PREFIX}/programs/{filled['hash']}/code", params={"measurement": "x"}).status_code == 422
    missing = client.get(f"{PREFIX}/programs/feedface")
    assert missing.status_code == 404 and "feedface" in missing.json()["detail"]
    bare = TestClient(_app(None)).get(f"{PREFIX}/programs")
    assert bare.status_code == 503 and "store" in bare.json()["detail"]


def test_mounted_by_the_api(filled: dict[str, Any]) -> None:
    from coconet.server.app import create_app

    with TestClient(create_app(filled["url"], token="t", workers=0, start_workers=False, hosts=("testserver",))) as c:
        assert c.get("/").status_code == 200
        assert [p["hash"] for p in c.get(f"{PREFIX}/programs").json()] == [filled["hash"]]


# -- in a browser


def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Served:
    def __init__(self, app: FastAPI) -> None:
        import uvicorn

        from coconet.server.http import server_config

        self.url = f"http://127.0.0.1:{_free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(server_config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    found = _chromium()
    if found is None:
        pytest.skip("no chromium + chromedriver (apt-get install -y chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-dev-shm-usage", "--window-size=1400,2600"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=found[1]), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: Any, script: str, timeout: float = 15.0) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: d.execute_script(script))


def _names(driver: Any, selector: str) -> list[list[str]]:
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(d => d.data.map(t => t.name))", selector)


def _render(driver: Any, url: str) -> None:
    driver.get(url)
    # The code block fills last: when it holds code, every plot before it was drawn.
    _wait(driver, "const c = document.querySelector('#code code').textContent;"
                  "return c.includes('def step(') || !document.querySelector('#error').hidden")


def test_page_renders_plots(filled: dict[str, Any], browser: Any) -> None:
    with _Served(_app(filled["store"])) as url:
        _render(browser, url + "/")
        error = browser.execute_script("const e = document.querySelector('#error'); "
                                       "return e.hidden ? '' : e.textContent")
        assert error == ""
        schedules = filled["schedules"]
        timing = {d["context"]: d["names"] for d in browser.execute_script(
            "return [...document.querySelectorAll('.timing-plot.js-plotly-plot')]"
            ".map(d => ({context: d.dataset.context, names: d.data.map(t => t.name)}))")}
        assert sorted(timing["local · 2 ranks"]) == sorted(f"gloo: {s}" for s in schedules)
        assert sorted(timing["dgx2 · 16 ranks"]) == sorted(f"nccl: {s}" for s in (schedules[0], schedules[2]))
        # every timing trace drew its three sizes as SVG points
        points = browser.execute_script(
            "return [...document.querySelectorAll('.timing-plot .scatterlayer .trace')]"
            ".map(t => t.querySelectorAll('.point').length)")
        assert points and set(points) == {3}
        assert sorted(_names(browser, "#speedup-plot.js-plotly-plot")[0]) == sorted(
            ["local · 2 ranks · gloo", "dgx2 · 16 ranks · nccl", "baseline (1×)"])
        assert _names(browser, "#history-plot.js-plotly-plot") == [["trial", "best so far", "failed"]]
        best = browser.execute_script("return document.querySelector('#history-plot').data[1].y")
        assert best == sorted(best, reverse=True) and len(best) == 5
        rows = browser.execute_script("return document.querySelectorAll('#results tbody tr').length")
        assert rows == 6
        # each winner says what its search let stay sharded, beside what it leaves sharded
        allowed = browser.execute_script(
            "return [...document.querySelectorAll('#results td.shardable')].map(c => c.textContent)")
        assert allowed == ["any state"] * 6
        assert "def step(" in browser.find_element("css selector", "#code code").text
        # another study from the select re-draws the history
        browser.execute_script("const s = document.querySelector('#study'); s.value = '2'; "
                               "s.dispatchEvent(new Event('change'))")
        _wait(browser, "return document.querySelector('#history-plot').layout.title.text.includes('N=1024')")


def test_page_shows_fetch_failures(browser: Any) -> None:
    with _Served(_app(None)) as url:  # no store attached: every data route answers 503
        browser.get(url + "/")
        text = _wait(browser, "const e = document.querySelector('#error'); return !e.hidden && e.textContent")
        assert "programs: HTTP 503" in text and "no results store" in text
        assert "could not load the programs" in browser.find_element("css selector", "#programs").text


@pytest.mark.skipif(not os.environ.get("COCONET_UPDATE_SCREENSHOT"),
                    reason="set COCONET_UPDATE_SCREENSHOT=1 to redraw docs/dashboard.png")
def test_screenshot(filled: dict[str, Any], browser: Any) -> None:
    """Redraw docs/dashboard.png, from the store at $COCONET_SCREENSHOT_DB (a real tuned one: coconet tune
    examples/adam.py --world 2 --size N=2^10 --size N=2^12 --size N=2^14 --budget 4 --db URL), else the
    synthetic one."""
    url = os.environ.get("COCONET_SCREENSHOT_DB")
    store = Store.open(url) if url else filled["store"]
    try:
        with _Served(_app(store)) as served:
            _render(browser, served + "/")
            height = browser.execute_script("return document.body.scrollHeight")
            browser.set_window_size(1400, min(height + 40, 4000))
            time.sleep(0.5)  # plotly re-lays out on resize
            SCREENSHOT.parent.mkdir(exist_ok=True)
            browser.save_screenshot(str(SCREENSHOT))
    finally:
        if url:
            store.close()


def test_winners_of_searches_allowing_different_state_are_apart_in_the_speedup_plot(tmp_path) -> None:
    from coconet.server.dashboard_data import program_view

    program = load_file(ROOT / "examples" / "adam.py")
    space = list(generate(program))
    base = space[0]
    zero3 = next(s for s in space if set(s.sharded) == {"m", "v", "w"})
    zero1 = next(s for s in space if set(s.sharded) == {"m", "v"})
    with Store.open(f"sqlite:///{tmp_path / 'store.db'}") as store:
        h = store.add_program(program)
        for sizes in SIZES:
            common = dict(sizes=sizes, topology="local", world=2, backend="shm", samples=[1e-3] * 3, n=3)
            ids = store.add_measurements([NewMeasurement.of(s, median_s=t, **common)
                                          for s, t in ((base, 3e-3), (zero3, 1e-3), (zero1, 2e-3))])
            store.add_winner(ids[1], baseline_id=ids[0])  # a search over every schedule
            store.add_winner(ids[2], baseline_id=ids[0], shardable="m,v")
        speedups = {s["context"]: s["speedup"] for s in program_view(store, h)["speedups"]}
    assert speedups == {"local · 2 ranks · shm · any state sharded": [3.0] * 3,
                        "local · 2 ranks · shm · m, v sharded": [1.5] * 3}
