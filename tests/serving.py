"""A live `hearth serve` process for tests: started on a free port, its log kept in a file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_SECONDS = 180  # loading the model on a busy 2-core machine can take a while


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class LiveServer:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        """The process's resident memory now."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS line")

    def wait_for_log(self, needle: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while needle not in (text := self.log()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{needle!r} not logged:\n{text[-3000:]}")
            time.sleep(0.05)
        return text

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)


def start_server(log_path: Path, *args: str) -> LiveServer:
    """`hearth serve` with `args` (default: the embedded model) at INFO, healthy."""
    port = free_port()
    command = [sys.executable, "-m", "hearth.cli", "serve", "--port", str(port), *args]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"}
        )
    server = LiveServer(process, port, log_path)
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"hearth serve exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.2)
    server.stop()
    raise RuntimeError("hearth serve did not become healthy in time")
