"""The HTTP front's chat page and mesh page against a real cluster (Redis, registry, lease
watch, scheduler, a prefill and two decode workers, a router with API keys), the first
tests over plain HTTP, the last in a real headless Chromium driven by Selenium: the chat
page streams an answer equal to the API's own, the mesh page lists the workers, the
placement the chat made, and drops a worker killed meanwhile. Screenshots of both pages
are saved in the test's output folder. The browser test skips, saying why, where
Chromium and its driver are not installed (Debian: ``apt-get install chromium
chromium-driver``)."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request

import pytest

from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.engine_args import EngineArgs

KEY = "k-web-pages-0123456789"
QUESTION = "Where do caravans rest?"
PAGE_MAX_TOKENS = 256  # what chat.html asks for


@pytest.fixture(scope="module")
def web_cluster(default_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{KEY}\n")
    cluster = Cluster(ClusterSpec(default_model_dir, num_prefill=1, num_decode=2, http_port=0, api_key_file=keys,
                                  registry_args=("--ttl", "2"),
                                  # bit-identical greedy tokens with or without a prefix hit: the page's
                                  # answer is compared with the API's to the last of 256 tokens
                                  engine=EngineArgs(dtype="float32", num_kv_blocks=128, deterministic=True)),
                      tmp_path_factory.mktemp("web-cluster-logs"))
    progress: list[tuple[list[str], list[str]]] = []  # what kervan up's start line is told
    cluster.on_progress = lambda serving, starting: progress.append((serving, starting))
    cluster.start(timeout=240)
    yield cluster, f"http://{cluster.addresses['router-http']}", progress
    cluster.stop()


def get(url: str, key: str | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def chat(base: str, messages: list[dict]) -> str:
    body = json.dumps({"messages": messages, "temperature": 0, "max_tokens": PAGE_MAX_TOKENS}).encode()
    request = urllib.request.Request(f"{base}/v1/chat/completions", body, {
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def test_the_launcher_tells_its_start_line_what_serves_and_what_still_starts(web_cluster):
    cluster, _, progress = web_cluster
    assert progress[0] == ([], ["kv-registry"])
    assert any(starting == ["router"] for _, starting in progress)
    assert sorted(cluster.serving) == ["decode-0", "decode-1", "kv-registry", "prefill-0", "router", "scheduler"]


def test_the_pages_need_no_key_and_what_they_show_does(web_cluster):
    _, base, _ = web_cluster
    for path, marker in (("/", b"v1/chat/completions"), ("/mesh", b"mesh/state")):
        status, headers, page = get(base + path)
        assert status == 200 and marker in page and headers["content-type"].startswith("text/html")
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
    status, _, body = get(f"{base}/mesh/state")
    assert status == 401 and b"invalid_api_key" in body
    status, _, body = get(f"{base}/mesh/state", KEY)
    state = json.loads(body)
    assert status == 200 and not state["unavailable"]
    assert sorted(w["role"] for w in state["workers"]) == ["decode", "decode", "prefill"]
    assert all(w["kv"]["pool"] == 128 for w in state["workers"])


def test_a_request_is_listed_with_its_placement(web_cluster):
    cluster, base, _ = web_cluster
    before = json.loads(get(f"{base}/mesh/state", KEY)[2])
    chat(base, [{"role": "user", "content": "Count the camels. " * 12}])  # long enough to prefill remotely
    after = json.loads(get(f"{base}/mesh/state", KEY)[2])
    assert len(after["placements"]) == len(before["placements"]) + 1
    newest = after["placements"][0]
    decoders = {cluster.addresses[n] for n in ("decode-0", "decode-1")}
    assert newest["decode"] in decoders or newest["worker"] in decoders
    assert after["placement_counts"]["placements"] == before["placement_counts"]["placements"] + 1


def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("no Chromium and chromedriver here (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,800"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def test_the_chat_page_streams_an_answer_and_the_mesh_page_loses_a_killed_worker(web_cluster, tmp_path):
    page = browser()  # skips, saying why, without Selenium, Chromium or its driver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    cluster, base, _ = web_cluster
    try:
        expected = chat(base, [{"role": "user", "content": QUESTION}])
        page.get(base + "/")
        WebDriverWait(page, 20).until(lambda p: "invalid_api_key" in p.find_element(By.ID, "model").text
                                      or "API key" in p.find_element(By.ID, "model").text)
        page.find_element(By.ID, "key").send_keys(KEY)
        page.find_element(By.ID, "question").click()  # the key field's change event: the page asks for the model
        WebDriverWait(page, 20).until(lambda p: p.find_element(By.ID, "model").text == cluster.spec.model_dir.name)
        page.find_element(By.ID, "question").send_keys(QUESTION)
        page.find_element(By.ID, "send").click()
        WebDriverWait(page, 20).until(lambda p: p.find_elements(By.CSS_SELECTOR, ".assistant[data-state=streaming]"))
        WebDriverWait(page, 120).until(lambda p: p.find_elements(By.CSS_SELECTOR, ".assistant[data-state=done]"))
        answer = page.find_element(By.CSS_SELECTOR, ".assistant")
        assert answer.get_attribute("textContent") == expected and expected
        page.save_screenshot(str(tmp_path / "chat.png"))

        page.get(base + "/mesh")  # the key stays in the tab's session storage
        rows = "tr[data-worker]"
        WebDriverWait(page, 20).until(lambda p: len(p.find_elements(By.CSS_SELECTOR, rows)) == 3)
        assert page.find_elements(By.CSS_SELECTOR, "#placements tr")  # the chat's placement, at least
        page.save_screenshot(str(tmp_path / "mesh.png"))
        victim = cluster.addresses["decode-1"]
        cluster.procs.pop("decode-1").kill()
        killed = time.monotonic()
        WebDriverWait(page, 30).until(lambda p: len(p.find_elements(By.CSS_SELECTOR, rows)) == 2)
        shown = [r.get_attribute("data-worker") for r in page.find_elements(By.CSS_SELECTOR, rows)]
        assert all(victim not in w for w in shown), shown
        page.save_screenshot(str(tmp_path / "mesh-after-kill.png"))
        print(f"screenshots in {tmp_path}; the killed worker left the page after {time.monotonic() - killed:.1f} s")
    finally:
        page.quit()
    for name in ("chat.png", "mesh.png", "mesh-after-kill.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
