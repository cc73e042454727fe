"""DS-1000's own metric: run a generated answer with its problem's test harness, in a sandbox; pass@1.

A DS-1000 problem carries ``code_context`` (Lai et al., 2022): ``generate_test_case``, ``exec_test``
and ``test_execution(solution)``, which inserts the answer into the problem's code, runs it on each
test input and compares the result with the reference's; some also define ``test_string(solution)``
(e.g. "the answer must not use a for loop"). The answer passes when both return without an error,
which is how DS-1000 scores it. pass@1 with one greedy answer per problem is the share that passes.

That is executing model output, so every run happens in a child process that:
- runs in a fresh temporary directory (its working directory and HOME, removed afterwards), with
  ``python -I`` (no PYTHONPATH, no user site, no current directory on the path);
- has no network: a network namespace of its own (``unshare -n``) where available, and in any case
  ``socket.socket`` and ``socket.create_connection`` replaced by ones that refuse;
- has resource limits (``resource.setrlimit``): CPU seconds, address space, the size of any file it
  writes, no core dumps;
- runs in a session of its own, killed as a whole process group when its wall-clock time is up.
"""
from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

PASSED, FAILED, TIMEOUT = "passed", "failed", "timeout"

NO_NETWORK = """\
import socket as _socket


class _NoNetwork(_socket.socket):  # a class, not a function: libraries subclass socket.socket at import
    def __init__(self, *args, **kwargs):
        raise OSError("the answer sandbox has no network")


def _refuse(*args, **kwargs):
    raise OSError("the answer sandbox has no network")


_socket.socket = _NoNetwork
_socket.create_connection = _refuse
del _socket
"""


@dataclass(frozen=True)
class SandboxLimits:
    """What one answer's run may use."""

    seconds: float = 60.0
    """Wall-clock seconds before the process group is killed (CPU seconds are capped at the same)."""
    memory_bytes: int = 4 << 30
    """Address space (RLIMIT_AS): numpy, pandas and scikit-learn map ~1-2 GB just by importing."""
    file_bytes: int = 16 << 20
    """Largest file the answer may write."""

    def __post_init__(self) -> None:
        if not 0 < self.seconds <= 3600:
            raise ValueError(f"seconds must be in (0, 3600], got {self.seconds!r}")
        if self.memory_bytes < 64 << 20 or self.file_bytes < 0:
            raise ValueError("memory_bytes must be at least 64 MiB and file_bytes not negative")


@dataclass(frozen=True)
class Outcome:
    status: str
    """passed, failed or timeout."""
    seconds: float
    detail: str = ""
    """The last line the harness printed on failure (the assertion or exception), at most 300 characters."""

    @property
    def passed(self) -> bool:
        return self.status == PASSED


def answer_code(text: str) -> str:
    """The code of a generated answer, as DS-1000's post-processing cuts it: up to ``</code>``,
    ``END SOLUTION`` or a closing Markdown fence, without an opening fence or ``<code>``."""
    code = text.replace("<code>", "")
    if "```" in code:
        parts = code.split("```")
        code = parts[1] if len(parts) > 2 else parts[-1]
        if code.startswith(("python\n", "py\n")):
            code = code.split("\n", 1)[1]
    for end in ("</code>", "END SOLUTION", "# SOLUTION END"):
        code = code.split(end, 1)[0]
    return code.strip("\n")


def test_program(code_context: str, solution: str) -> str:
    """The program that checks ``solution`` with a DS-1000 harness (as DS-1000's own evaluation builds it)."""
    program = [NO_NETWORK, code_context, f"code = {solution!r}", "test_execution(code)"]
    if "def test_string(" in code_context:
        program.append("test_string(code)")
    return "\n".join(program) + "\n"


def run_answer(code_context: str, solution: str, limits: SandboxLimits = SandboxLimits()) -> Outcome:
    """Run ``solution`` through the problem's harness in a sandboxed child process."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedmoe-answer-") as tmp:
        path = os.path.join(tmp, "check.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(test_program(code_context, solution))
        proc = subprocess.Popen([*network_isolation(), sys.executable, "-I", path], cwd=tmp, env=_child_env(tmp),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=functools.partial(_limit, limits))
        try:
            _, err = proc.communicate(timeout=limits.seconds)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return Outcome(TIMEOUT, time.monotonic() - started, f"killed after {limits.seconds:g} s")
        finally:
            _kill_group(proc)  # anything the answer left running in its session
    seconds = time.monotonic() - started
    if proc.returncode == 0:
        return Outcome(PASSED, seconds)
    if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # its CPU seconds ran out first
        return Outcome(TIMEOUT, seconds, f"out of CPU time ({limits.seconds:g} s)")
    lines = err.decode("utf-8", "replace").strip().splitlines()
    return Outcome(FAILED, seconds, (lines[-1] if lines else f"exit status {proc.returncode}")[:300])


def pass_at_1(outcomes: Sequence[Outcome]) -> float:
    """Share of problems whose one answer passed (0 for no problem)."""
    return sum(o.passed for o in outcomes) / len(outcomes) if outcomes else 0.0


@functools.lru_cache(maxsize=1)
def network_isolation() -> tuple[str, ...]:
    """The command prefix that gives a child no network: ``unshare -n`` (root), ``unshare -rn`` (user
    namespaces), or nothing where neither works (the refusing sockets then stand alone)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for flags in ("-n", "-rn"):
        try:
            if subprocess.run([unshare, flags, "true"], capture_output=True, timeout=10).returncode == 0:
                return (unshare, flags)
        except (OSError, subprocess.TimeoutExpired):
            continue
    return ()


def _child_env(home: str) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "TMPDIR": home, "MPLBACKEND": "Agg",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    # Some processors here need OpenBLAS's core type pinned for correct results: pass those settings on.
    return env | {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_CORETYPE") or k == "OPENBLAS_L2_SIZE"}


def _limit(limits: SandboxLimits) -> None:
    """In the child before exec: its resource limits."""
    cpu = int(limits.seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
