"""A minimal Chrome DevTools Protocol client over ``--remote-debugging-pipe`` (stdlib only).

``Browser`` starts headless Chromium with the DevTools pipe on file descriptors 3 and 4 (JSON
messages ended by a NUL byte), opens one page and sends commands to it. With ``offline=True``
every host name resolves to nothing (``--host-resolver-rules``), so a page can only reach
numeric addresses such as the 127.0.0.1 server that serves it. Every network request the page
makes is recorded (``requests``), so a caller can prove that nothing left the machine.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


class CdpError(RuntimeError):
    """Chromium could not be started, did not answer, or rejected a command."""


def find_chromium() -> str:
    """The Chromium executable; a message saying how to install it when there is none."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise CdpError("no Chromium on PATH: install Debian's package (apt-get install chromium)")


class Browser:
    """Headless Chromium driving one page over the DevTools pipe; use as a context manager."""

    def __init__(self, *, width: int = 1400, height: int = 900, offline: bool = True) -> None:
        self.width, self.height, self.offline = width, height, offline
        self.requests: list[str] = []
        self._next_id = 0
        self._buffer = b""
        self._session = ""

    def __enter__(self) -> Browser:
        self._profile = tempfile.TemporaryDirectory(prefix="embshard-chromium-")
        to_r, self._to_w = os.pipe()
        self._from_r, from_w = os.pipe()
        args = [
            find_chromium(),
            "--headless=new",
            "--remote-debugging-pipe",
            f"--user-data-dir={self._profile.name}",
            f"--window-size={self.width},{self.height}",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
        ]
        if os.geteuid() == 0:
            args.append("--no-sandbox")  # Chromium refuses to start its sandbox as root
        if self.offline:
            args.append("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")
        shell = f'exec "$0" "$@" 3<&{to_r} 4>&{from_w}'
        self._proc = subprocess.Popen(
            ["bash", "-c", shell, *args, "about:blank"],
            pass_fds=(to_r, from_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        os.close(to_r)
        os.close(from_w)
        target = self._call("Target.createTarget", {"url": "about:blank"}, session=False)
        attach = {"targetId": target["targetId"], "flatten": True}
        self._session = self._call("Target.attachToTarget", attach, session=False)["sessionId"]
        self.call("Network.enable")
        self.call("Page.enable")
        metrics = {"width": self.width, "height": self.height, "deviceScaleFactor": 1}
        self.call("Emulation.setDeviceMetricsOverride", {**metrics, "mobile": False})
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._to_w)
        os.close(self._from_r)
        self._profile.cleanup()

    # ----- protocol ------------------------------------------------------------------------

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_r], [], [], max(left, 0))
            if not ready:
                raise CdpError("Chromium did not answer in time")
            chunk = os.read(self._from_r, 1 << 20)
            if not chunk:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise CdpError(f"Chromium exited: {err.strip()[-800:]}")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    def _call(
        self, method: str, params: dict[str, Any] | None = None, *, session: bool = True
    ) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_w, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 60
        while True:
            reply = self._read_message(deadline)
            if reply.get("method") == "Network.requestWillBeSent":
                self.requests.append(reply["params"]["request"]["url"])
            if reply.get("id") != self._next_id:
                continue
            if "error" in reply:
                raise CdpError(f"{method} failed: {reply['error']}")
            result: dict[str, Any] = reply.get("result", {})
            return result

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send ``method`` to the page; its result."""
        return self._call(method, params)

    # ----- page helpers --------------------------------------------------------------------

    def goto(self, url: str) -> None:
        """Navigate the page (a change of ``#hash`` included)."""
        self.call("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page; a thrown error is raised."""
        got = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in got:
            raise CdpError(f"{expression[:80]!r} threw: {got['exceptionDetails'].get('text')}")
        return got["result"].get("value")

    def wait_for(self, expression: str, *, timeout: float = 30.0, what: str = "") -> Any:
        """Poll ``expression`` until it is truthy; its value. Raises after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except CdpError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise CdpError(f"timed out after {timeout:.0f} s waiting for {what or expression}")
            time.sleep(0.2)

    def screenshot(self, path: Path) -> Path:
        """Save a PNG of the viewport to ``path``."""
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        path.write_bytes(base64.b64decode(data))
        return path
