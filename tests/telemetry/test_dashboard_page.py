"""/dashboard in a real browser: Debian's Chromium, headless, driven through Selenium and Debian's chromedriver (no
browser download), against `python -m service serve` on the default model (tests/serving/test_processes.py checks
that every front end answers the same data).

The service guards its metrics with a token: the page must ask for it (and ask again for a wrong one), then draw
every chart from the service's own numbers, show the counts /metrics shows, keep its console clean, and say the
service is down when the engine process is killed. The screenshot goes to
$DASHBOARD_SCREENSHOT when set, else into the test's folder; $DASHBOARD_LOAD_SECONDS keeps a load of four
streams going that long first (docs/img/dashboard.png: DASHBOARD_LOAD_SECONDS=120).
"""

import asyncio
import os
import shutil
import signal

import openai
from prometheus_client.parser import text_string_to_metric_families

from service.telemetry.dashboard import quantile
from tests import web
from tests.conftest import needs_tools, wait_until
from tests.served import Served

CHROMIUM, DRIVER = "chromium", "chromedriver"
TOKEN = "dashboard-test-token"


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,2000", "--hide-scrollbars"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=shutil.which(DRIVER)), options=options)


def metrics(url: str) -> dict[tuple, float]:
    """/metrics as {(sample name, frozen labels): value}."""
    found = {}
    scrape = web.get(url + "/metrics", timeout=30, headers={"Authorization": f"Bearer {TOKEN}"})
    for family in text_string_to_metric_families(scrape.text):
        for s in family.samples:
            found[(s.name, frozenset(s.labels.items()))] = s.value
    return found


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, w) in ls for k, w in labels.items()))


def bucket_of(value: float, bounds: list[float]) -> int:
    return next(i for i, b in enumerate(bounds) if value <= b + 1e-12)


async def load(url: str, model: str, seconds: float = 0.0) -> int:
    """A small load: chat requests of a few tokens, eight at once, then one streamed (after `seconds` of four
    streams one after another each); the number of requests."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    ask = [{"role": "user", "content": f"Count to {i}."} for i in range(8)]
    done = [9]
    async with client:
        async def streams(until):
            while asyncio.get_running_loop().time() < until:
                stream = await client.chat.completions.create(model=model, messages=ask[done[0] % 8:][:1],
                                                              max_tokens=48, temperature=0.7, stream=True)
                async for _ in stream:
                    pass
                done[0] += 1
        if seconds:
            until = asyncio.get_running_loop().time() + seconds
            await asyncio.gather(*(streams(until) for _ in range(4)))
        await asyncio.gather(*(client.chat.completions.create(model=model, messages=[m], max_tokens=12,
                                                              temperature=0) for m in ask))
        stream = await client.chat.completions.create(model=model, messages=ask[:1], max_tokens=6, stream=True)
        async for _ in stream:
            pass
    return done[0]


@needs_tools(CHROMIUM, DRIVER)
def test_the_page_draws_the_services_own_numbers_and_says_when_it_is_down(tmp_path):
    with Served("--metrics-token", TOKEN, model=None, timeout=300) as s:
        driver = browser()
        try:
            driver.get(s.url + "/dashboard")
            state = lambda: driver.find_element("id", "status").get_attribute("data-state")
            for token in ("wrong", TOKEN):  # the page asks for the token, and again when it is refused
                wait_until(lambda: state() == "auth" and driver.find_element("id", "auth").is_displayed(), 30,
                           "the page to ask for the token")
                field = driver.find_element("id", "token")
                field.clear()
                field.send_keys(token + "\n")
                if token == "wrong":
                    wait_until(lambda: "refused" in driver.find_element("id", "auth-msg").text, 30,
                               "the page to say the token was refused")
            wait_until(lambda: state() == "up", 30, "the page to be let in")
            driver.get_log("browser")  # the 401s of the wrong token are Chrome's own console errors: drop them
            model = web.get(s.url + "/v1/models").json()["data"][0]["id"]
            seconds = float(os.environ.get("DASHBOARD_LOAD_SECONDS", 0))
            requests = asyncio.run(load(s.url, model, seconds))
            charts = driver.execute_script("return Object.keys(window.dashboard.charts)")
            assert {"requests", "ttft", "itl", "e2e", "throughput"} <= set(charts), charts
            drawn = """return Object.entries(window.dashboard.charts).filter(([name, c]) =>
                !(c.data[0].length > 0 && c.data.slice(1).some(s => s.some(v => v != null)))).map(([n]) => n)"""
            wait_until(lambda: driver.execute_script(drawn) == [], 60, "every chart to have points")
            # the counts equal /metrics' once the history has the last request in it
            shown = lambda: {el.get_attribute("data-total"): el.text
                             for el in driver.find_elements("css selector", "[data-total]")}
            wait_until(lambda: shown()["requests_finished"] == str(requests), 30, "the page to count every request")
            m = metrics(s.url)
            counts = {"requests_received": total(m, "llm_requests_received_total"),
                      "requests_finished": total(m, "llm_requests_total"),
                      "requests_error": total(m, "llm_requests_total", finish_reason="error"),
                      "requests_abort": total(m, "llm_requests_total", finish_reason="abort"),
                      "output_tokens": total(m, "llm_generation_tokens_total"),
                      "prompt_tokens": total(m, "llm_prompt_tokens_total"),
                      "preemptions": total(m, "llm_preemptions_total"),
                      "rejected_503": total(m, "llm_http_requests_total", status="503")}
            assert {k: shown()[k] for k in counts} == {k: str(int(v)) for k, v in counts.items()}
            assert counts["requests_finished"] == requests and counts["output_tokens"] > requests
            # latencies: each percentile shown (over the last minute) lies in the bucket /metrics (since the start)
            # puts the same percentile in: the same observations, unless a longer load began over a minute ago
            latencies = (("ttft", "llm_time_to_first_token_seconds"), ("e2e", "llm_request_duration_seconds"),
                         ("itl", "llm_time_per_output_token_seconds"))
            for key, name in latencies if seconds <= 30 else ():
                buckets = sorted((float(dict(ls)["le"]), v) for (n, ls), v in m.items() if n == name + "_bucket")
                bounds = [le for le, _ in buckets]
                for label, q in (("p50", 0.5), ("p99", 0.99)):
                    el = driver.find_element("css selector", f'[data-latest="{key}_{label}"]')
                    page = float(el.get_attribute("data-value"))
                    assert bucket_of(page, bounds) == bucket_of(quantile(q, buckets), bounds), (key, label, page)
            errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
            assert errors == []
            assert driver.find_element("id", "status").get_attribute("data-state") == "up"
            driver.save_screenshot(os.environ.get("DASHBOARD_SCREENSHOT") or str(tmp_path / "dashboard.png"))
            # the engine process is killed: the service ends, and the page says so instead of freezing
            polls = driver.execute_script("return window.dashboard.polls")
            os.kill(s.engine_pid, signal.SIGKILL)
            wait_until(lambda: driver.find_element("id", "status").get_attribute("data-state") == "down", 60,
                       "the page to say the service is down")
            assert "down" in driver.find_element("id", "status").text.lower()
            assert driver.execute_script("return window.dashboard.polls") >= polls
            assert s.proc.wait(60) == 1
        finally:
            driver.quit()
