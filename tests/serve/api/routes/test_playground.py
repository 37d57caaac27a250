"""The playground page and /docs in a real headless browser (Debian's chromium, driven over the
DevTools protocol on a pipe: no browser download, no driver package), against the real server on
127.0.0.1. scripts/test.sh installs chromium when it is missing; without it these tests skip."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests import REPO

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")

from ldlm.pipeline import LDLMPipeline  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium on PATH (scripts/test.sh installs it: apt-get install -y "
    "chromium); the page and /docs were not exercised in a browser",
)
SCREENSHOT = Path(os.environ.get("LDLM_TEST_ARTIFACTS", REPO / "test-artifacts")) / "playground.png"


class Browser:
    """Headless chromium over --remote-debugging-pipe: JSON messages, NUL-terminated, on fds 3 and 4."""

    def __init__(self) -> None:
        self.profile = tempfile.TemporaryDirectory(prefix="ldlm-chromium-", ignore_cleanup_errors=True)
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        to_browser_r, from_browser_w = (self._above_4(fd) for fd in (to_browser_r, from_browser_w))
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--window-size=1000,800",
            f"--user-data-dir={self.profile.name}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        # the browser expects its pipe ends at fds 3 (commands in) and 4 (answers out): the shell moves them there
        move = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-'
        self.process = subprocess.Popen(
            ["bash", "-c", move, CHROMIUM, *flags],
            pass_fds=(to_browser_r, from_browser_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Network"):
            self.call(f"{domain}.enable", session=True)

    @staticmethod
    def _above_4(fd: int) -> int:
        """The fd moved to 10 or above, so that placing the pipe ends at 3 and 4 cannot close one of them."""
        moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
        os.close(fd)
        return moved

    def call(self, method: str, session: bool = False, timeout_s: float = 30, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.time() + timeout_s
        while True:
            reply = self._read(deadline - time.time())
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_browser], [], [], max(0.0, timeout_s))
            chunk = os.read(self._from_browser, 1 << 20) if ready else b""
            if not chunk:
                raise TimeoutError("the browser did not answer")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def wait_for(self, expression: str, timeout_s: float = 30) -> None:
        deadline = time.time() + timeout_s
        while not self.evaluate(expression):
            assert time.time() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.05)

    def requested_urls(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def close(self) -> None:
        # chromium's helper processes (renderer, crashpad) can still be writing the profile after the
        # main process exits: ask it to close, then end its whole process group before removing the profile
        try:
            self.call("Browser.close", timeout_s=10)
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(10)
        os.close(self._to_browser)
        os.close(self._from_browser)
        for attempt in range(20):
            try:
                shutil.rmtree(self.profile.name)
                break
            except FileNotFoundError:
                break
            except OSError:
                if attempt == 19:
                    raise
                time.sleep(0.25)


@pytest.fixture(scope="module")
def server(export_dir: Path):
    # Every preview, in order: the tiny model's whole run lasts a fraction of a second, so within the
    # default shares (5% beside others, a third alone) how many previews fit depends on the machine's
    # speed, and the page's sharpening is what is checked here, not the shares.
    settings = ServerSettings(
        port=free_port(), max_batch=8, request_timeout_s=60, max_n=8, max_steps=1000, preview_budget=1.0, preview_lone_budget=1.0
    )
    running = RunningServer(LDLMService(str(export_dir), settings))
    yield running
    running.stop()


@pytest.fixture()
def browser():
    opened = Browser()
    yield opened
    opened.close()


def test_playground_shows_the_text_sharpening(server: RunningServer, browser: Browser, pipeline: LDLMPipeline) -> None:
    browser.open(server.url + "/")
    assert browser.evaluate("document.title") == "ldlm playground"
    browser.evaluate("""(() => { const set = (id, v) => document.getElementById(id).value = v;
                        set('length', 24); set('steps', 300); set('seed', 3); set('every', 4);
                        document.getElementById('go').click(); })()""")
    seen: list[str] = []  # the preview area's text each time it changed, as the page shows it
    deadline = time.time() + 60
    while browser.evaluate("document.body.dataset.state") != "done":
        assert browser.evaluate("document.body.dataset.state") != "error", browser.evaluate("document.getElementById('status').textContent")
        assert time.time() < deadline, "the generation did not finish"
        text = browser.evaluate("document.getElementById('preview').textContent")
        if text and (not seen or seen[-1] != text):
            seen.append(text)
        time.sleep(0.01)
    final = browser.evaluate("document.getElementById('preview').textContent")
    assert len(seen) >= 3, f"the preview area changed {len(seen) - 1} times: {seen}"  # changed at least twice before the end
    assert browser.evaluate("document.getElementById('status').textContent").startswith("Done: 300 steps")
    assert browser.evaluate("document.getElementById('preview').classList.contains('final')")
    # The independent reference: the eager PyTorch pipeline of the checkpoint the served graphs were
    # exported from, with the page's inputs and the sampler its request leaves to the default ("dpm3m-psc").
    assert final == pipeline.generate(1, 24, 300, seed=3, sampler="dpm3m-psc").texts[0]
    assert all(u.startswith(server.url) or u.startswith("data:") for u in browser.requested_urls()), browser.requested_urls()
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    shot = browser.call("Page.captureScreenshot", session=True, format="png")["data"]
    partial = SCREENSHOT.with_suffix(".png.partial")
    partial.write_bytes(base64.b64decode(shot))
    partial.replace(SCREENSHOT)
    print(f"screenshot: {SCREENSHOT}")


def test_docs_render_from_local_assets(server: RunningServer, browser: Browser) -> None:
    browser.open(server.url + "/docs")
    browser.wait_for("!!document.querySelector('.swagger-ui .info .title')")
    assert "ldlm" in browser.evaluate("document.querySelector('.swagger-ui .info .title').textContent")
    browser.wait_for("document.querySelectorAll('.opblock').length > 0")
    assert browser.evaluate("[...document.querySelectorAll('.opblock-summary-path')].some(e => e.textContent.includes('/v1/completions'))")
    urls = browser.requested_urls()
    assert any(u.endswith("/static/swagger/swagger-ui-bundle.js") for u in urls)
    assert all(u.startswith(server.url) or u.startswith("data:") for u in urls), urls  # no CDN


KEY = "pl4yground-k3y"


@pytest.fixture(scope="module")
def keyed_server(export_dir: Path):
    settings = ServerSettings(port=free_port(), max_batch=8, request_timeout_s=60, max_n=8, max_steps=1000, api_key=KEY)
    running = RunningServer(LDLMService(str(export_dir), settings))
    yield running
    running.stop()


def run_page(browser: Browser, key: str, sampler: str | None = None, prior_temperature: float | None = None) -> str:
    """Fill the form (length 12, 20 steps, seed 5, the API key field, the sampler and prior temperature if
    given), generate, and wait for the end: the final state."""
    choose = f"set('sampler', {json.dumps(sampler)});" if sampler else ""
    choose += f"set('tau', {prior_temperature});" if prior_temperature is not None else ""
    browser.evaluate(f"""(() => {{ const set = (id, v) => document.getElementById(id).value = v;
                        set('length', 12); set('steps', 20); set('seed', 5); set('every', 5); set('key', {json.dumps(key)}); {choose}
                        document.getElementById('go').click(); }})()""")
    browser.wait_for("['done', 'error'].includes(document.body.dataset.state)", 60)
    return browser.evaluate("document.body.dataset.state")


def test_with_a_key_the_page_opens_and_sends_the_key_it_is_given(
    keyed_server: RunningServer, browser: Browser, pipeline: LDLMPipeline
) -> None:
    browser.open(keyed_server.url + "/")  # no key: the page itself is open
    assert browser.evaluate("document.title") == "ldlm playground"
    assert run_page(browser, "") == "error"  # no key typed: the API refuses, and the page says why
    assert "missing or wrong bearer token" in browser.evaluate("document.getElementById('status').textContent")
    assert run_page(browser, "wrong") == "error"
    assert run_page(browser, KEY) == "done"
    assert (
        browser.evaluate("document.getElementById('preview').textContent")
        == pipeline.generate(1, 12, 20, seed=5, sampler="dpm3m-psc").texts[0]
    )


def test_with_a_key_docs_render(keyed_server: RunningServer, browser: Browser) -> None:
    browser.open(keyed_server.url + "/docs")
    browser.wait_for("document.querySelectorAll('.opblock').length > 0")
    assert browser.evaluate("[...document.querySelectorAll('.opblock-summary-path')].some(e => e.textContent.includes('/v1/generate'))")


def test_with_a_key_every_api_route_still_needs_it(keyed_server: RunningServer) -> None:
    import httpx

    with httpx.Client(base_url=keyed_server.url, timeout=30) as http:
        for path in ("/", "/docs", "/openapi.json", "/static/swagger/swagger-ui.css", "/v2/health/live", "/v2/health/ready"):
            assert http.get(path).status_code == 200, path
        closed = [
            ("GET", "/v2"),
            ("GET", "/v2/models/encoder"),
            ("GET", "/v2/models/encoder/ready"),
            ("GET", "/metrics"),
            ("GET", "/v1/models"),
            ("POST", "/v2/models/encoder/infer"),
            ("POST", "/v1/generate"),
            ("POST", "/v1/reconstruct"),
            ("POST", "/v1/encode"),
            ("POST", "/v1/completions"),
            ("GET", "/docs/"),
            ("GET", "/openapi.json/x"),
            ("GET", "//v1/models"),
        ]
        for method, path in closed:
            response = http.request(method, path, json={})
            assert response.status_code == 401, (path, response.status_code)
        assert http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
