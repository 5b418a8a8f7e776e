"""Build the documentation site, serve it on a local port and check it in headless Chromium.

Usage: ``python scripts/check_site.py OUT_DIR [--mermaid FILE]``, from the repository
root with the ``docs`` extra installed (it brings ``websockets``, which drives Chromium
over the DevTools protocol). It checks that

- every page of the site loads (its article and its title are in the DOM),
- the search finds "abort": the index (``search/search_index.json``) has it, and the
  search box opened with ``?q=abort`` lists results,
- the Mermaid diagrams render: every diagram of the design page became an ``<svg>``
  (Material draws it in a closed shadow root, which the DevTools protocol can read),

and saves two screenshots into OUT_DIR: ``index.png`` and ``design-state-machine.png``.
It exits 0 when every check passed and 1 when one failed; with no Chromium installed it
prints a line that says SKIPPED and exits 0 (Debian: ``apt-get install chromium``;
tests/test_site.py checks the built HTML without a browser).

Material loads Mermaid from a CDN. Offline, this script gives its own copy of the built
site a local ``mermaid.min.js`` (``--mermaid``, else ``~/.cache/omni_trio/mermaid.min.js``,
else it fetches the ``mermaid`` package with ``npm pack`` into that cache); Material uses
a Mermaid that is already loaded. The built site itself is unchanged.
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
MERMAID_CACHE = Path.home() / ".cache" / "omni_trio" / "mermaid.min.js"
#: Seconds a page may take to load, or the search and Mermaid to finish (chosen, not
#: measured: both take about a second here).
WAIT_S = 30.0


def report(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def find_browser() -> str | None:
    """The first Chromium on PATH, or ``None``."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def build(site: Path) -> None:
    """``mkdocs build --strict`` into ``site``."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    subprocess.run(command, cwd=ROOT, check=True, env=env)


def mermaid_js(given: Path | None) -> Path | None:
    """A local ``mermaid.min.js``: the one given, the cached one, or one from npm."""
    if given is not None:
        return given
    if MERMAID_CACHE.is_file():
        return MERMAID_CACHE
    npm = shutil.which("npm")
    if npm is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        packed = subprocess.run(
            [npm, "pack", "mermaid@11", "--pack-destination", tmp],
            capture_output=True,
            check=False,
        )
        tarballs = list(Path(tmp).glob("mermaid-*.tgz"))
        if packed.returncode != 0 or not tarballs:
            return None
        with tarfile.open(tarballs[0]) as tar:
            member = tar.extractfile("package/dist/mermaid.min.js")
            if member is None:
                return None
            MERMAID_CACHE.parent.mkdir(parents=True, exist_ok=True)
            MERMAID_CACHE.write_bytes(member.read())
    return MERMAID_CACHE


def add_mermaid(site: Path, script: Path) -> list[str]:
    """Load the local Mermaid in every page with a diagram; return those pages' paths."""
    shutil.copy(script, site / "assets" / "mermaid.min.js")
    pages = []
    for page in sorted(site.rglob("index.html")):
        html = page.read_text()
        if 'class="mermaid"' not in html:
            continue
        path = page.parent.relative_to(site).as_posix()
        depth = 0 if path == "." else len(page.parent.relative_to(site).parts)
        tag = f'<script src="{"../" * depth}assets/mermaid.min.js"></script>'
        page.write_text(html.replace("</head>", tag + "</head>", 1))
        pages.append("" if path == "." else f"{path}/")
    return pages


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def serve(site: Path) -> Iterator[str]:
    """Serve ``site`` on a free port of 127.0.0.1; yield its base URL."""
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="check-site-http")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


class Browser:
    """One headless Chromium page, driven over the DevTools protocol."""

    def __init__(self, executable: str, profile: Path) -> None:
        from websockets.sync.client import connect

        self._log = (profile / "stderr.log").open("w+")
        self._process = subprocess.Popen(
            [
                executable,
                "--headless",
                "--no-sandbox",  # root in a container
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile / 'profile'}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        port = self._devtools_port()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as answer:
            targets = json.load(answer)
        page = next(t for t in targets if t["type"] == "page")
        self._exits = ExitStack()
        self._socket = self._exits.enter_context(
            connect(page["webSocketDebuggerUrl"], max_size=None)
        )
        self._next = 0
        self.call("Page.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=1280,
            height=900,
            deviceScaleFactor=1,
            mobile=False,
        )

    def _devtools_port(self) -> int:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            self._log.seek(0)
            for line in self._log.read().splitlines():
                if "DevTools listening on ws://" in line:
                    return int(line.split("ws://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
            time.sleep(0.1)
        raise RuntimeError("Chromium did not open its DevTools port")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command; return its result (events in between are dropped)."""
        self._next += 1
        self._socket.send(json.dumps({"id": self._next, "method": method, "params": params}))
        while True:
            message = json.loads(self._socket.recv(timeout=WAIT_S))
            if message.get("id") == self._next:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message["result"]
                return result

    def evaluate(self, expression: str) -> Any:
        answer = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return answer["result"].get("value")

    def wait_for(self, expression: str) -> bool:
        """Poll ``expression`` until it is true, for at most ``WAIT_S``."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if self.evaluate(expression):
                return True
            time.sleep(0.2)
        return False

    def goto(self, url: str) -> bool:
        """Open ``url``; whether it finished loading."""
        self.call("Page.navigate", url=url)
        time.sleep(0.1)  # let the navigation start before reading readyState
        return self.wait_for("document.readyState === 'complete'")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def rendered_svgs(self) -> int:
        """Mermaid diagrams on this page drawn as an <svg>, shadow roots included."""
        root = self.call("DOM.getDocument", depth=-1, pierce=True)["root"]
        count = 0
        stack = [root]
        while stack:
            node = stack.pop()
            attributes = node.get("attributes", [])
            classes = dict(zip(attributes[::2], attributes[1::2], strict=True)).get("class", "")
            if node.get("nodeName") == "DIV" and "mermaid" in classes.split():
                shadow = [*node.get("shadowRoots", [])]
                found = False
                while shadow and not found:
                    inner = shadow.pop()
                    found = inner.get("nodeName", "").lower() == "svg"
                    shadow += inner.get("children", []) + inner.get("shadowRoots", [])
                count += found
            stack += node.get("children", []) + node.get("shadowRoots", [])
        return count

    def close(self) -> None:
        self._exits.close()
        self._process.terminate()
        self._process.wait(timeout=WAIT_S)
        self._log.close()


def check_pages(browser: Browser, base: str, site: Path) -> list[str]:
    """Every page loads: its DOM has the article of a Material page with a title."""
    failures = []
    pages = sorted(p.parent.relative_to(site).as_posix() for p in site.rglob("index.html"))
    for page in pages:
        path = "" if page == "." else f"{page}/"
        loaded = browser.goto(base + path)
        if not loaded or not browser.evaluate("!!document.querySelector('.md-content h1')"):
            failures.append(f"page /{path} did not load")
    report(f"pages: {len(pages) - len(failures)} of {len(pages)} loaded")
    return failures


def check_search(browser: Browser, base: str, site: Path) -> list[str]:
    """The index has "abort", and the search box opened with ?q=abort lists results."""
    index = json.loads((site / "search" / "search_index.json").read_text())
    hits = [d["location"] for d in index["docs"] if "abort" in d["text"].lower()]
    browser.goto(base + "?q=abort")
    listed = browser.wait_for("document.querySelectorAll('.md-search-result__item').length > 0")
    results = browser.evaluate("document.querySelectorAll('.md-search-result__item').length")
    meta = browser.evaluate("document.querySelector('.md-search-result__meta').textContent")
    report(f"search: 'abort' in {len(hits)} index entries; the search box: {meta!r}, {results}")
    failures = []
    if not any(h.startswith("tutorial/") for h in hits):
        failures.append("search index: no tutorial entry has 'abort'")
    if not listed:
        failures.append("search: ?q=abort listed no results")
    return failures


def check_mermaid(browser: Browser, base: str, site: Path, pages: list[str]) -> list[str]:
    """On each page with a diagram, Mermaid drew every one of them as an <svg>."""
    failures = []
    for path in pages:
        browser.goto(base + path)
        diagrams = (site / path / "index.html").read_text().count('class="mermaid"')
        browser.wait_for("document.querySelectorAll('pre.mermaid').length === 0")
        svgs = browser.rendered_svgs()
        report(f"mermaid: /{path}: {svgs} of {diagrams} diagrams drawn as <svg>")
        if svgs < diagrams:
            failures.append(f"mermaid: /{path} drew {svgs} of {diagrams} diagrams")
    if not pages:
        failures.append("mermaid: no page has a diagram")
    return failures


def take_screenshots(browser: Browser, base: str, out: Path) -> list[str]:
    """The home page, and the design page scrolled to its state machine."""
    browser.goto(base)
    browser.screenshot(out / "index.png")
    browser.goto(base + "design/")
    browser.wait_for("document.querySelectorAll('pre.mermaid').length === 0")
    # One scroll down, to the heading less the header bar (scrolling up shows "Back to top").
    browser.evaluate(
        "window.scrollTo(0, document.getElementById('the-request-state-machine')"
        ".getBoundingClientRect().top + window.scrollY - 72)"
    )
    time.sleep(0.5)  # the scroll lands before the shot
    browser.screenshot(out / "design-state-machine.png")
    failures = []
    for name in ("index.png", "design-state-machine.png"):
        shot = out / name
        saved = shot.is_file() and shot.stat().st_size > 0
        report(f"screenshot: {shot} {'saved' if saved else 'MISSING'}")
        if not saved:
            failures.append(f"screenshot {name} missing")
    return failures


def check(executable: str, out: Path, mermaid: Path | None) -> list[str]:
    """Build, serve and check the site; return what failed."""
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        build(site)
        script = mermaid_js(mermaid)
        failures = []
        pages: list[str] = []
        if script is None:
            failures.append("mermaid: no local mermaid.min.js (offline, and npm pack failed)")
        else:
            pages = add_mermaid(site, script)
        with serve(site) as base:
            report(f"check_site: {executable}, serving the site at {base}")
            browser = Browser(executable, Path(tmp))
            try:
                failures += check_pages(browser, base, site)
                failures += check_search(browser, base, site)
                if script is not None:
                    failures += check_mermaid(browser, base, site, pages)
                failures += take_screenshots(browser, base, out)
            finally:
                browser.close()
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the two screenshots")
    parser.add_argument("--mermaid", type=Path, help="a local mermaid.min.js (Mermaid 11)")
    args = parser.parse_args()
    executable = find_browser()
    if executable is None:
        report(f"check_site: SKIPPED: no Chromium on PATH (looked for {', '.join(BROWSERS)})")
        report("check_site: on Debian: apt-get install chromium")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    failures = check(executable, args.out, args.mermaid)
    for failure in failures:
        report(f"check_site: FAILED: {failure}")
    report("check_site: every check passed" if not failures else "check_site: failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
