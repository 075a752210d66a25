"""Starting the real servers for tests and benchmarks: subprocesses on 127.0.0.1, an
ephemeral port each, stopped (with every process they started) on exit."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

SRC = Path(__file__).resolve().parents[1] / "src"


class ServerProcess:
    """``python -m mmferry ARGS --port 0``; ``url`` once it printed where it listens."""

    def __init__(self, *args: str, log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": "1"}
        self._log = open(log, "w+b")  # noqa: SIM115 (kept open for the process's life)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mmferry", *args, "--port", "0"], stdout=subprocess.PIPE,
            stderr=self._log, env=env, start_new_session=True)
        self.url = ""

    def wait_ready(self, timeout: float = 120.0) -> str:
        """Block until ``/health`` answers 200; the base URL."""
        deadline = time.monotonic() + timeout
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode()
        if "listening on " not in line:
            raise RuntimeError(f"server did not start: {line!r}\n{self.log()}")
        self.url = line.rsplit("listening on ", 1)[1].strip()
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited {self.process.returncode}\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=30, trust_env=False).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout} s\n{self.log()}")

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
        # The server's own session: its forkserver and workers go with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._log.close()
