"""The README's first command, proved: `skippyd serve` answers a chat completion.

Run with the interpreter of a virtualenv holding only ``.[model]``; standard library
only, so nothing the test extra installs can hide a missing runtime dependency.

    python .ci/serve_smoke.py PATH/TO/skippyd
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(base: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"skippyd serve exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"skippyd serve was not healthy within {START_TIMEOUT_S:.0f} s")


def chat(base: str) -> str:
    body = json.dumps({
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16, "temperature": 0,
    }).encode()
    request = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        reply = json.load(response)
    text = reply["choices"][0]["message"]["content"]
    if not text or reply["usage"]["completion_tokens"] < 1:
        raise SystemExit(f"empty completion: {reply}")
    return text


def main() -> int:
    skippyd = sys.argv[1]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as runtime_dir:
        # The control socket goes to a private directory, not the user's default one.
        env = dict(os.environ, XDG_RUNTIME_DIR=runtime_dir)
        server = subprocess.Popen([skippyd, "serve", "--listen", f"127.0.0.1:{port}"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_healthy(base, server)
            text = chat(base)
            server.send_signal(signal.SIGTERM)
            code = server.wait(timeout=STOP_TIMEOUT_S)
        except BaseException:
            server.kill()
            print(server.communicate()[0], file=sys.stderr)
            raise
        if code != 0:
            print(server.communicate()[0], file=sys.stderr)
            raise SystemExit(f"skippyd serve exited with {code} after SIGTERM")
    print(f"serve smoke: ok ({text!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
