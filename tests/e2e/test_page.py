"""The built-in page (GET /, control_plane/static/) in a real browser: Debian's chromium, headless,
driven by Playwright, against real servers of the tiny random model.

- the page asks for the API key (the server runs with --api-key), then polls and draws the pools,
  with no console error;
- a chat answer streams into the playground, with its TTFT and tokens/s;
- during a batch of n = 3 requests sharing a prompt prefix, the coloured cells are exactly the used
  blocks that /debug/kv reports, shared cells show their ref count, and hovering a sequence numbers
  its table's cells in logical order (the screenshot of that moment is docs/ui.png: set
  PAGEDSERVE_UPDATE_SCREENSHOT=1 to rewrite it);
- under a pool too small for the batch (--preemption-mode swap), cells move to the CPU grid and back;
- markup in the model's output (forced by a JSON schema) and in the user's message shows as text and
  runs nothing.

Chromium comes from Debian (apt-get install chromium; .ci/run installs it, and so does this module
when it runs as root and the binary is missing): Playwright's own browser download is not used.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request

import pytest

from tests.servers import ROOT, Server

pytestmark = pytest.mark.slow
KEY = "page-test-key"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PREFIX = list(range(1000, 1040))    # 40 prompt tokens every request of the batch shares (2.5 blocks)
SCREENSHOT = os.path.join(ROOT, "docs", "ui.png")


def chromium_binary() -> str:
    """Debian's chromium; installed with apt-get when missing and this runs as root (as .ci/run does)."""
    path = shutil.which("chromium") or (os.path.exists("/usr/bin/chromium") and "/usr/bin/chromium")
    if not path and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"], env=env,
                       check=False, capture_output=True)
        path = shutil.which("chromium")
    if not path:
        message = "Debian's chromium is missing (apt-get install -y chromium)"
        if os.environ.get("CI"):
            pytest.fail(message + ": CI must install it (.ci/run)")
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extras)")
    executable = chromium_binary()
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def start(tmp_path_factory, name: str, args: list[str]) -> Server:
    return Server(name, args, str(tmp_path_factory.mktemp(name)), swap_space_gib=None)


@pytest.fixture(scope="module")
def servers(heavier_model_dir, tmp_path_factory):
    """Started together, both on the heavier model (a batch must last while the page is read, and a swapped
    sequence stay swapped while its row is hovered: on the tiny model swaps came and went within a few steps of
    milliseconds): a roomy pool behind an API key, and a pool too small for its batch (swapping)."""
    common = ["--model", heavier_model_dir, "--num-threads", "1"]
    started = {
        "keyed": start(tmp_path_factory, "page-keyed", common + ["--api-key", KEY, "--kv-cache-blocks", "512",
                                                                 "--swap-blocks", "64"]),
        "small": start(tmp_path_factory, "page-small", common + ["--kv-cache-blocks", "24", "--swap-blocks", "96",
                                                                 "--preemption-mode", "swap",
                                                                 "--max-num-seqs", "8"]),
    }
    try:
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def keyed(servers):
    return servers["keyed"].wait_ready()


@pytest.fixture(scope="module")
def small(servers):
    return servers["small"].wait_ready()


class Page:
    """A browser tab on a server's page, with every console error and uncaught exception it had."""

    def __init__(self, browser, server: Server, key: str | None = None):
        self.server = server
        self.key = key
        self.context = browser.new_context(viewport={"width": 1500, "height": 1050})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.goto(server.url + "/")
        if key is not None:   # the page asks for it before it calls anything
            self.page.locator("#key-dialog").wait_for(state="visible")
            self.page.fill("#key-input", key)
            self.page.click("#key-submit")
            self.page.mouse.move(1, 1)   # off the sequence list, which now lies under the dialog's button
        self.wait_snapshots(1)

    def __enter__(self) -> "Page":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def snapshots(self) -> int:
        return int(self.page.get_attribute("#map-panel", "data-snapshots"))

    def wait_snapshots(self, count: int, timeout: float = 30) -> None:
        wait_until(self.page, f"Number(document.getElementById('map-panel').dataset.snapshots) >= {count}", timeout)

    def step(self) -> None:
        """While paused: one more snapshot, drawn."""
        seen = self.snapshots()
        self.page.click("#step")
        self.wait_snapshots(seen + 1)

    def count(self, selector: str) -> int:
        return self.page.eval_on_selector_all(selector, "els => els.length")

    def close(self) -> None:
        self.context.close()


def wait_until(page, js: str, timeout: float = 30) -> None:
    """Polls the JavaScript expression `js` until it is true. (Playwright's wait_for_function compiles its
    predicate with eval, which the page's Content-Security-Policy forbids; evaluate is not affected.)"""
    deadline = time.monotonic() + timeout
    while not page.evaluate(f"() => Boolean({js})"):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout:.0f} s: {js}")
        time.sleep(0.1)


def debug_kv(server: Server, key: str | None = None) -> dict:
    req = urllib.request.Request(server.url + "/debug/kv", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


def completions(server: Server, bodies: list[dict], key: str | None = None) -> concurrent.futures.Future:
    """Sends the bodies at once from other threads; the future gives their (status, body) in order."""
    def one(body):
        req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
        with urllib.request.urlopen(req, timeout=600) as resp:
            return resp.status, json.load(resp)
    pool = concurrent.futures.ThreadPoolExecutor(len(bodies) + 1)
    futures = [pool.submit(one, b) for b in bodies]
    done = pool.submit(lambda: [f.result() for f in futures])
    pool.shutdown(wait=False)
    return done


def test_the_page_asks_for_the_key_then_draws_the_pools_without_console_errors(browser, keyed):
    with Page(browser, keyed, KEY) as tab:
        tab.wait_snapshots(3)                             # it keeps polling, with the key
        assert tab.count(".grid.device .cell") == 512 and tab.count(".grid.cpu .cell") == 64
        assert tab.count(".grid.device .cell.held") == 0
        assert "0 of 512 device blocks in use" in tab.page.text_content("#map-summary")
        wait_until(tab.page, "document.getElementById('model').textContent.includes('on cpu')")
        assert tab.page.text_content("#status") == "live"
        # the charts are drawn from what it polled: 4 canvases, not blank
        blank = tab.page.evaluate("""() => [...document.querySelectorAll('canvas')].map(c =>
            c.getContext('2d').getImageData(0, 0, c.width, c.height).data.every(v => v === 0))""")
        assert blank == [False] * 4
        assert tab.errors == []


def test_a_chat_answer_streams_with_its_ttft_and_tokens_per_second(browser, keyed):
    with Page(browser, keyed, KEY) as tab:
        p = tab.page
        # how often the answer's text changed in a separate task: more than once means it streamed
        p.evaluate("""() => { window.__updates = 0;
            new MutationObserver(() => window.__updates++).observe(document.getElementById('chat-log'),
                {childList: true, subtree: true, characterData: true}); }""")
        p.fill("#max-tokens", "48")
        p.fill("#temperature", "0")
        p.fill("#chat-input", "Tell me about paged attention.")
        p.click("#send")
        p.wait_for_selector(".msg.assistant[data-done='true']", timeout=60_000)
        answer = p.text_content(".answer .text")
        stats = p.text_content(".answer .stats")
        assert answer and p.text_content(".msg.user .text") == "Tell me about paged attention."
        match = re.fullmatch(r"TTFT (\d+) ms · (\d+) tokens · ([\d.]+) tokens/s · (length|stop)", stats)
        assert match, stats
        assert int(match[2]) == 48 or match[4] == "stop"
        assert float(match[3]) > 0
        assert p.evaluate("window.__updates") > 3         # the user turn, the answer box, then the text in parts
        assert p.text_content("#chat-error") == "" and tab.errors == []


def test_the_map_is_the_pool_during_a_shared_prefix_parallel_sampling_batch(browser, keyed):
    with Page(browser, keyed, KEY) as tab:
        p = tab.page
        bodies = [{"prompt": PREFIX + [2000 + i, 2100 + i, 2200 + i, 2300 + i], "n": 3, "max_tokens": 400,
                   "ignore_eos": True, "temperature": 1.0, "seed": i} for i in range(4)]
        batch = completions(keyed, bodies, KEY)
        wait_until(p, "document.querySelectorAll('.grid.device .cell.shared').length > 0", 60)
        # a few blocks of output each: the samples' own blocks after their shared prompt
        wait_until(p, "document.querySelectorAll('.grid.device .cell.held').length >= 60", 120)
        p.click("#pause")
        matched = None
        for _ in range(30):                                # a snapshot between two equal /debug/kv readings
            time.sleep(0.5)                                # the page steps at most twice a second
            before = debug_kv(keyed, KEY)["device_blocks_used"]
            tab.step()
            after = debug_kv(keyed, KEY)["device_blocks_used"]
            held = tab.count(".grid.device .cell.held")
            # the page's own count is the same snapshot's
            assert f"{held} of 512 device blocks in use" in p.text_content("#map-summary")
            if before == after:
                matched = (held, before)
                break
        assert matched is not None and not batch.done(), "the batch ended before a steady moment was seen"
        held, used = matched
        assert held == used > 0
        shared = p.eval_on_selector_all(".grid.device .cell.shared", "els => els.map(e => e.textContent)")
        assert shared and all(int(t) > 1 for t in shared), shared
        assert max(int(t) for t in shared) >= 3            # the prompt's blocks: 3 samples (and prefix hits)
        # hovering a parallel sample numbers its table's cells in logical order, in its colour's grid
        row = p.locator("#seq-list li[data-state='running']").nth(1)
        row.hover()
        detail = p.text_content("#seq-detail")
        table = [int(b) for b in re.findall(r"\d+→(\d+)", detail)]
        numbers = p.eval_on_selector_all(".grid.device .cell.hl", "els => els.map(e => [+e.dataset.block, e.textContent])")
        assert sorted(numbers) == sorted([b, str(i)] for i, b in enumerate(table)) and len(table) >= 3
        assert "running" in detail and re.search(r"44 prompt \+ \d+ output tokens", detail)
        png = p.screenshot()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
        if os.environ.get("PAGEDSERVE_UPDATE_SCREENSHOT"):
            with open(SCREENSHOT, "wb") as f:
                f.write(png)
        assert tab.errors == []
        assert [status for status, _ in batch.result(timeout=300)] == [200] * 4


# the hovered row's state and the highlighted cells of both grids, read together
HOVERED = """() => { const li = document.querySelector('#seq-list li.active');
  return li && {state: li.dataset.state, cpu: document.querySelectorAll('.grid.cpu .cell.hl').length,
                device: document.querySelectorAll('.grid.device .cell.hl').length}; }"""


def test_swapped_sequences_move_to_the_cpu_grid_and_back(browser, small):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout   # (installed: the fixture has it)
    with Page(browser, small) as tab:                        # no --api-key here: no question asked
        p = tab.page
        assert not p.locator("#key-dialog").is_visible()
        bodies = [{"prompt": [3000 + 7 * i + j for j in range(20)], "max_tokens": 300, "ignore_eos": True,
                   "temperature": 0} for i in range(6)]
        batch = completions(small, bodies)
        wait_until(p, "document.querySelectorAll('.grid.cpu .cell.held').length > 0", 90)
        # a swapped sequence may come back in between finding its row and reading the grids (the page
        # redraws the list and both grids from each new snapshot), so the hovered row's state and both
        # grids' highlights are read in one evaluation, of one drawing; hover again until the row read
        # is still swapped
        seen, deadline = None, time.monotonic() + 60
        while time.monotonic() < deadline:
            swapped = p.locator("#seq-list li[data-state='swapped']")
            if swapped.count() > 0:
                try:
                    swapped.first.hover(timeout=2000)
                except PlaywrightTimeout:   # its row changed state before the mouse got there
                    continue
                seen = p.evaluate(HOVERED)
                if seen and seen["state"] == "swapped":
                    break
            time.sleep(0.05)
        assert seen and seen["state"] == "swapped", seen
        assert seen["cpu"] > 0 and seen["device"] == 0, seen   # its table is in the CPU pool now
        p.mouse.move(0, 0)
        assert [status for status, _ in batch.result(timeout=300)] == [200] * 6
        assert debug_kv(small)["preemptions"]["swap"] > 0
        # back, and then done: every cell of both grids is free again
        wait_until(p, "document.querySelectorAll('.grid .cell.held').length === 0", 30)
        assert tab.errors == []


def test_markup_from_the_model_and_the_user_is_shown_as_text_and_runs_nothing(browser, keyed):
    with Page(browser, keyed, KEY) as tab:
        p = tab.page
        markup = "<script>window.__ran = 1</script><img src=x onerror=\"window.__ran = 2\">"
        # a schema whose only valid answer is that markup (as a JSON string): the model must output it
        p.fill("#schema", json.dumps({"const": "<script>window.__ran = 3</script><img src=x onerror=window.__ran=4>"}))
        p.fill("#max-tokens", "64")
        p.fill("#chat-input", markup)
        p.click("#send")
        p.wait_for_selector(".msg.assistant[data-done='true']", timeout=120_000)
        assert p.text_content(".msg.user .text") == markup
        answer = p.text_content(".answer .text")
        assert json.loads(answer) == "<script>window.__ran = 3</script><img src=x onerror=window.__ran=4>", answer
        assert p.eval_on_selector_all("#chat-log script, #chat-log img", "els => els.length") == 0
        p.wait_for_timeout(300)                            # an image's onerror would have run by now
        assert p.evaluate("window.__ran") is None
        assert p.text_content("#chat-error") == "" and tab.errors == []
