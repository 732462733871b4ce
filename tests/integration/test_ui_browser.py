"""The product as a user meets it, in a real browser (headless Debian Chromium driven by Selenium)
against the real Prefect server, S3 server and stage server: the deployments are listed, the
tokenize deployment's form renders its descriptions (no text lost to markdown), a run started from
the form fails for a fixable cause (no completions yet), the cause is fixed, Retry is pressed on the
run's page, the run completes and its artifacts and task runs are listed. Then the session's pipeline
deployment run of two stages, tokenize -> train, retried to completion (`retried_pipeline`,
tests/integration/shared_runs.py; test_stage_deployments.py checks its retries): its page draws the run
graph, saved as a screenshot (path printed), and the graph the UI draws (the server's graph-v2) has the
edge from tokenize to train. Then the evidence of its last attempt,
followed by its links: the run's summary, the checkpoint's lineage page (producer flow run and task run
linked, the target and tokenizer among its inputs), its parent the tokenized dataset's page with the
completions it was made from, and the run's S3 usage and its chart (an image that must load). Screenshots
of the page are saved (path printed) when a step fails.

Needs `chromium` and `chromium-driver` (Debian) and `selenium` (the dev extra); skips, saying which is
missing, otherwise. Run: `.venv/bin/python -m pytest -q tests/integration/test_ui_browser.py`
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.test_tokenize_flow import shard
from tests.unit.conftest_tokenize import MODEL_CACHE

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="needs Debian's chromium and chromium-driver "
                                "(infra/setup.sh installs them where it runs as root on Debian)")


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e '.[dev]')")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def _page_text(driver) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.TAG_NAME, "body").text


def _wait_text(driver, *texts: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = _page_text(driver)
        if all(t in text for t in texts):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"{[t for t in texts if t not in text]} not on {driver.current_url}")
        time.sleep(0.5)


def _click_button(driver, label: str, *, timeout_s: float = 30.0) -> None:
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        buttons = [b for b in driver.find_elements(By.TAG_NAME, "button") if b.text.strip() == label and b.is_displayed()]
        if buttons:
            buttons[-1].click()  # the last one: a confirmation dialog's button sits after the page's
            return
        time.sleep(0.5)
    raise AssertionError(f"no {label!r} button on {driver.current_url}")


def _click_tab(driver, label: str, *, timeout_s: float = 30.0) -> None:
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tabs = [e for e in driver.find_elements(By.XPATH, f"//*[normalize-space(.)='{label}']") if e.is_displayed()]
        if tabs:
            tabs[-1].click()  # the innermost element with that text
            return
        time.sleep(0.5)
    raise AssertionError(f"no {label!r} tab on {driver.current_url}")


def _api(base: str, path: str, body: dict | None = None):
    request = urllib.request.Request(f"{base}/api{path}", data=json.dumps(body).encode() if body is not None else None,
                                     method="POST" if body is not None else "GET",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def _wait_state(base: str, flow_run_id: str, *, timeout_s: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = _api(base, f"/flow_runs/{flow_run_id}")
        if run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        time.sleep(0.5)
    raise TimeoutError(f"flow run {flow_run_id} did not finish in {timeout_s} s")


def _run_ids(base: str, deployment_id: str) -> set[str]:
    return {run["id"] for run in _api(base, "/flow_runs/filter", {"deployments": {"id": {"any_": [deployment_id]}}})}


def _new_run(base: str, deployment_id: str, known: set[str], *, timeout_s: float = 30.0) -> str:
    """The flow run the form created (the UI goes back to the deployment's page; the nightly schedule
    adds runs of its own, for 03:00 UTC)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for run_id in _run_ids(base, deployment_id) - known:
            run = _api(base, f"/flow_runs/{run_id}")
            if run["state_name"] != "Scheduled" or run["expected_start_time"] <= _utc_iso(time.time() + 60):
                return run_id
        time.sleep(0.5)
    raise AssertionError("the form created no flow run")


def _follow_the_evidence(driver, base: str, pipeline_run: str, *, dataset: str, shots: Path) -> None:
    """From the pipeline run's page to its summary, to the checkpoint's lineage page (who made it, linked), through
    its parent to the tokenized dataset's page and the completions it names; then the run's S3 usage and its chart,
    an image that loads."""
    # A retried run has these of each attempt: follow the last attempt's.
    last = {key: f"/artifacts/artifact/{_newest_artifact(base, pipeline_run, key)}"
            for key in ("pipeline-summary", "s3-usage", "s3-usage-by-kind")}
    driver.get(f"{base}/runs/flow-run/{pipeline_run}")
    _wait_text(driver, "Completed")
    _click_tab(driver, "Artifacts")
    _wait_text(driver, "pipeline-summary", "s3-usage", "s3-usage-by-kind")
    _open_link(driver, containing="pipeline-summary", href_part=last["pipeline-summary"])
    _wait_text(driver, "dflash pipeline: stages", "tokenize", "train", "Artifacts (each with a .manifest.json")
    driver.save_screenshot(str(shots / "pipeline-summary.png"))

    _open_link(driver, containing="lineage of checkpoints/", href_part="/artifacts/artifact/")
    checkpoint = _wait_text(driver, "Lineage of checkpoint", "Made by", "Inputs (what made it)", "target-model",
                            "tokenizer", "Lineage graph")
    assert "mermaid" not in checkpoint and "none (written by the flow itself)" not in checkpoint  # a task run each
    assert _links(driver, "/runs/flow-run/") and _links(driver, "/runs/task-run/"), "its producer is linked"
    driver.save_screenshot(str(shots / "checkpoint-lineage.png"))

    _open_link(driver, containing=f"tokenized/{dataset}/", href_part="/artifacts/artifact/")
    page = _wait_text(driver, "Lineage of tokenized", "shard-00000.arrow", "Fed (what was made from it)")
    # Its inputs: the completion shards by sha256 (put there by hand: no manifest, so no page of their own).
    assert "shard-00000.jsonl" in page and "shard-00001.jsonl" in page and f"completions/{dataset}/" in page
    assert "checkpoints/" in page.split("Fed (what was made from it)", 1)[1], "the checkpoint it fed"
    driver.save_screenshot(str(shots / "dataset-lineage.png"))

    driver.get(f"{base}/runs/flow-run/{pipeline_run}")
    _click_tab(driver, "Artifacts")
    _open_link(driver, containing="s3-usage", href_part=last["s3-usage"], whole_line=True)
    _wait_text(driver, "This run wrote", "A cleanup would reclaim", "Unmanifested", "by run prefix", "checkpoint")
    driver.get(f"{base}/runs/flow-run/{pipeline_run}")
    _click_tab(driver, "Artifacts")
    _open_link(driver, containing="s3-usage-by-kind", href_part=last["s3-usage-by-kind"])
    _wait_image(driver)
    driver.save_screenshot(str(shots / "s3-usage-chart.png"))
    print(f"the evidence as the UI shows it: {shots}/{{pipeline-summary,checkpoint-lineage,dataset-lineage,"
          f"s3-usage-chart}}.png")


def _newest_artifact(base: str, flow_run_id: str, key: str) -> str:
    [artifact] = _api(base, "/artifacts/filter", {"artifacts": {"key": {"any_": [key]}, "flow_run_id": {"any_": [
        flow_run_id]}}, "sort": "CREATED_DESC", "limit": 1})
    return artifact["id"]


# Every link on the page as (href, text) in one round trip: asking each anchor for its href and text costs two
# WebDriver calls an anchor, seconds a pass on a page of artifact cards on a busy 2-core machine.
_ANCHORS_JS = ("return Array.from(document.getElementsByTagName('a'), a => [typeof a.href === 'string' ? a.href"
               " : (a.getAttribute('href') || ''), a.innerText || ''])")


def _anchors(driver) -> list[tuple[str, str]]:
    return [(href or "", text or "") for href, text in driver.execute_script(_ANCHORS_JS)]


def _links(driver, href_part: str) -> list[str]:
    return [href for href, _ in _anchors(driver) if href_part in href]


def _open_link(driver, *, containing: str, href_part: str, whole_line: bool = False, timeout_s: float = 30.0) -> None:
    """Go where the link points whose text contains `containing` (as one whole line of it: an artifact card's key)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for href, text in _anchors(driver):
            found = containing in [line.strip() for line in text.splitlines()] if whole_line else containing in text
            if href_part in href and found:
                driver.get(href)
                return
        time.sleep(0.5)
    raise AssertionError(f"no link with {containing!r} to {href_part} on {driver.current_url}")


def _wait_image(driver, *, timeout_s: float = 30.0) -> None:
    """An image on the page that the browser loaded (decoded, with a width)."""
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        images = [img for img in driver.find_elements(By.TAG_NAME, "img")
                  if (img.get_attribute("src") or "").startswith("data:image/png")]
        loaded = "return arguments[0].complete && arguments[0].naturalWidth"
        if any(driver.execute_script(loaded, img) for img in images):
            return
        time.sleep(0.5)
    raise AssertionError(f"no loaded PNG on {driver.current_url}")


def _wait_graph_drawn(driver, *, timeout_s: float = 30.0) -> None:
    """The run graph's canvas on the page, drawn: its pixels (as the browser shows them) not one blank colour."""
    import io

    from PIL import Image
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for canvas in driver.find_elements(By.CSS_SELECTOR, ".run-graph__stage canvas"):
            if canvas.size["width"] and canvas.size["height"] and canvas.is_displayed():
                colours = Image.open(io.BytesIO(canvas.screenshot_as_png)).getcolors(maxcolors=4)
                if colours is None:  # more than 4 colours: something drawn
                    return
        time.sleep(0.25)
    raise AssertionError(f"no run graph drawn on {driver.current_url}")


def _park(driver) -> None:
    """Leave the UI while a run works: a Prefect page polls and redraws, a core's worth of CPU in
    headless Chromium, which the run's processes on a 2-core machine need."""
    driver.get("about:blank")


def _utc_iso(seconds: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat()


def test_deploy_form_run_fail_fix_retry_in_the_browser(browser, stage_server, retried_pipeline, store, settings,
                                                       tmp_path):
    from dflash_core.embedded import TOKENIZER_DIR_NAME, embedded_tokenizer_dir

    base = settings.prefect_api_url.removesuffix("/api")
    for prefix in ("completions/demo/smollm2/", "tokenized/demo/smollm2/"):  # the form's defaults: start empty
        store.delete_many([item.key for item in store.list(prefix)])
    try:
        browser.get(f"{base}/deployments")
        # The list shows 10 deployments a page, by name: these are on the first.
        _wait_text(browser, "embedded-demo", "evaluate", "export", "generate", "pipeline")

        deployment = _api(base, "/deployments/name/dflash-tokenize/tokenize")
        browser.get(f"{base}/deployments/deployment/{deployment['id']}/run")
        form = _wait_text(browser, "What to tokenize", "Tokenized run name")
        assert "tokenized///" not in form and "tokenized/(dataset)/(output_run)/" in form
        known = _run_ids(base, deployment["id"])
        for attempt in range(3):  # the UI's first request on a busy 2-core machine sometimes errors ("Oops")
            _click_button(browser, "Submit")
            try:
                flow_run_id = _new_run(base, deployment["id"], known, timeout_s=10)
                break
            except AssertionError:
                if attempt == 2:
                    raise
        _park(browser)
        run = _wait_state(base, flow_run_id)
        assert run["state_type"] == "FAILED" and "no completion shards" in run["state"]["message"]

        # The fix: the completions arrive (and the stage server's tokenizer cache is filled from the tests' one).
        models = settings.work_path("models")
        if not (models / TOKENIZER_DIR_NAME).exists():
            shutil.copytree(embedded_tokenizer_dir(MODEL_CACHE), models / TOKENIZER_DIR_NAME)
        for index in range(2):
            store.put_bytes(f"completions/demo/smollm2/shard-{index:05d}.jsonl", shard(index))

        browser.get(f"{base}/runs/flow-run/{flow_run_id}")
        _wait_text(browser, "Failed")
        _click_button(browser, "Retry")
        _wait_text(browser, "will be run again")  # the confirmation dialog
        _click_button(browser, "Retry")  # its button (the last one on the page)
        deadline = time.monotonic() + 20
        while _api(base, f"/flow_runs/{flow_run_id}")["state_type"] == "FAILED":
            assert time.monotonic() < deadline, "pressing Retry did not put the run back to AwaitingRetry"
            time.sleep(0.5)
        _park(browser)
        run = _wait_state(base, flow_run_id)
        assert run["state_type"] == "COMPLETED", run["state"]
        assert run["run_count"] == 2  # the same flow run, retried in place

        browser.get(f"{base}/runs/flow-run/{flow_run_id}")
        _wait_text(browser, "Completed")
        _click_tab(browser, "Artifacts")
        _wait_text(browser, "tokenize-report", "tokenize-stats")
        _click_tab(browser, "Task Runs")
        _wait_text(browser, "tokenize completions/demo/smollm2/shard-00000.jsonl")

        # A pipeline deployment run of two stages (tokenize -> train), retried to completion.
        assert retried_pipeline.completed.state.is_completed(), retried_pipeline.completed.state
        pipeline_run = str(retried_pipeline.completed.id)
        browser.get(f"{base}/runs/flow-run/{pipeline_run}")
        _wait_text(browser, "Completed")
        _wait_graph_drawn(browser)  # the graph's canvas draws after the text
        shot = Path(tmp_path) / "pipeline-run-graph.png"
        browser.save_screenshot(str(shot))
        print(f"run graph of pipeline flow run {pipeline_run}: {shot}")
        # The graph the page draws: the train stage's node has the tokenize stage's as its parent.
        nodes = dict(_api(base, f"/flow_runs/{pipeline_run}/graph-v2")["nodes"])
        by_flow = {node["label"].split(" / ")[0]: node_id for node_id, node in nodes.items()
                   if node["kind"] == "flow-run"}
        assert set(by_flow) == {"dflash-tokenize", "dflash-train"}, [n["label"] for n in nodes.values()]
        assert [edge["id"] for edge in nodes[by_flow["dflash-train"]]["parents"]] == [by_flow["dflash-tokenize"]]
        _follow_the_evidence(browser, base, pipeline_run, dataset=retried_pipeline.dataset, shots=Path(tmp_path))
    except Exception:
        shot = Path(tmp_path) / "ui-failure.png"
        browser.save_screenshot(str(shot))
        print(f"screenshot of {browser.current_url}: {shot}")
        raise
