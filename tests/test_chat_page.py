"""The chat page at `/`: headless Chromium (Debian's chromium) loads it from a running `engine serve`, asks a question
through the page's form path and its `?q=` link, and waits for the streamed reply in the DOM; a screenshot is kept
in the test's output folder. Driven over the DevTools protocol (websocket-client)."""
import base64
import json
import shutil
import subprocess
import time

import httpx
import pytest

from test_server import free_port, start_server

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One Chromium tab over the DevTools protocol."""

    def __init__(self, ws_url: str):
        import websocket
        self.ws, self.next_id = websocket.create_connection(ws_url, timeout=30), 0

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(msg["error"])
                return msg["result"]

    def js(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_for(self, expression: str, seconds: float = 120):
        deadline = time.time() + seconds
        while time.time() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {expression}: page text {self.js('document.body.innerText')!r}")


@pytest.fixture
def browser(tmp_path):
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (Debian's chromium package)")
    pytest.importorskip("websocket")
    port = free_port()
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                             "--disable-background-networking", "--disable-component-update", "--disable-sync",
                             f"--user-data-dir={tmp_path / 'profile'}", f"--remote-debugging-port={port}",
                             "--remote-allow-origins=*", "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, targets = time.time() + 30, []
        while time.time() < deadline and not targets:
            try:
                targets = [t for t in httpx.get(f"http://127.0.0.1:{port}/json", timeout=1).json() if t["type"] == "page"]
            except httpx.HTTPError:
                time.sleep(0.2)
        assert targets, "chromium did not open its debugging port"
        page = Page(targets[0]["webSocketDebuggerUrl"])
        page.call("Runtime.enable")
        yield page
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_chat_page_streams_a_reply(browser, model_path, tmp_path):
    model_path("smol")
    server, base = start_server("--parallel", "2", "--ctx", "1024", "--api-key", "secret")
    try:
        assert httpx.get(base + "/").status_code == 200               # the page is open; the API wants the key
        browser.call("Page.navigate", url=base + "/")
        browser.wait_for("document.readyState === 'complete' && !!document.getElementById('form')")
        browser.js("localStorage.setItem('engine-key', 'secret'); localStorage.setItem('engine-max-tokens', '48')")
        browser.call("Page.navigate", url=base + "/?q=" + "What%20is%20the%20capital%20of%20France%3F")
        reply = browser.wait_for("(() => { const a = document.querySelector('.msg.assistant');"
                                 " return a && a.dataset.done ? a.textContent : ''; })()")
        assert reply.strip(), "an empty reply"
        assert browser.js("document.getElementById('max').value") == "48"       # the page's length limit
        assert browser.js("document.getElementById('model').textContent") == "smollm2-135m"     # /v1/models' id
        # a second turn through the form: the conversation so far goes with it
        browser.js("document.getElementById('input').value = 'And of Italy?';"
                   " document.getElementById('form').requestSubmit(); 1")
        second = browser.wait_for("(() => { const a = document.querySelectorAll('.msg.assistant');"
                                  " return a.length == 2 && a[1].dataset.done ? a[1].textContent : ''; })()")
        assert second.strip() and browser.js("document.querySelectorAll('.msg.user').length") == 2
        assert browser.js("document.querySelectorAll('.msg.error').length") == 0
        shot = tmp_path / "chat-page.png"
        shot.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot")["data"]))
        print(f"screenshot: {shot}")
        # without the key the page says what went wrong, in the conversation
        browser.js("localStorage.removeItem('engine-key')")
        browser.call("Page.navigate", url=base + "/?q=hi")
        error = browser.wait_for("(() => { const e = document.querySelector('.msg.error');"
                                 " return e ? e.textContent : ''; })()")
        assert "API key" in error, error
    finally:
        server.terminate()
        server.wait(timeout=10)
