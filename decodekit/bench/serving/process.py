"""A server as a subprocess on a loopback port: started and waited for through `/health`, its output in a log
file, its resident memory, stopped with SIGTERM (then SIGKILL)."""

from __future__ import annotations

import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_rss_bytes(pid: int) -> int | None:
    """A process's resident memory (psutil if installed, else /proc/PID/status VmRSS); None if it is gone."""
    try:
        import psutil

        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return None
    except ImportError:
        pass
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class ServerStartError(RuntimeError):
    """A server subprocess could not be started, or did not answer `/health` in time."""


class ServerProcess:
    """A server subprocess on a loopback port; `start` waits until `/health` answers 200, `stop` sends SIGTERM
    (then SIGKILL after `stop_timeout_s`). Its output goes to a temporary log file (`log_tail` reads it)."""

    def __init__(self, command: Sequence[str], port: int, *, env: dict[str, str] | None = None,
                 name: str = "server") -> None:
        self.command = list(command)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.env = env
        self.name = name
        self.process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.log_path = Path(self._log.name)

    @property
    def pid(self) -> int | None:
        """The subprocess's id (None before `start`)."""
        return self.process.pid if self.process is not None else None

    def start(self, timeout_s: float = 300.0) -> ServerProcess:
        """Launch the command and wait for `/health`.

        Raises:
            ServerStartError: the command cannot run, exits, or does not answer within `timeout_s`.
        """
        try:
            self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env)
        except OSError as exc:
            raise ServerStartError(f"cannot run {self.command[0]}: {exc}") from None
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(f"{self.name} exited with status {code} before answering /health; its "
                                       f"output ends with:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"{self.name} did not answer /health within {timeout_s:.0f}s; its output "
                                       f"ends with:\n{self.log_tail()}")
            time.sleep(0.25)

    def rss_bytes(self) -> int | None:
        """The server process's resident memory now."""
        return process_rss_bytes(self.process.pid) if self.process is not None else None

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of the server's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, stop_timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; returns the exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["ServerProcess", "ServerStartError", "free_port", "process_rss_bytes"]
