"""Times what issue 30's start-up targets name, as a user meets them (a real process each).

    python bench/startup.py [--trials 3] [--cmd localllm] [--only warm,fresh,serve]

warm:  `localllm run "What is the capital of France?"` on the caches as they are: seconds to
       the first byte of the answer on stdout, and to the process's exit.
fresh: the same with new user folders (HOME, XDG_CACHE_HOME, XDG_DATA_HOME, XDG_CONFIG_HOME
       in a temp folder, LOCALLLM_HOME and LOCALLLM_CACHE_DIR unset): the CPU kernels are
       built and the decode step compiled as on a new machine. The model is copied in from
       the user's models folder (no pull: the network is not what is timed), so run one
       warm start first. Once answered, `run` finishes compiling the decode step for the
       next start (minutes): ctrl+c skips it here unless --finish.
serve: `localllm serve --chats 16` on the warm caches: seconds to the first /health 200.
chat:  `localllm chat` on new user folders (as fresh), in a tmux terminal: seconds until the
       app is usable (its key bar painted: it takes input), then the question typed at once
       with Enter, and seconds until the screen shows the reply's "Paris". Needs tmux.
Each line gives the process's CPU seconds (user + system, its children included) beside the
wall time: on a shared machine compare those. "cpu" beside the first token is what the process
and its finished children (the kernel build's compilers) had used by then: the first answer's
own cost, without a background build still running. The CPU model and the load are printed first.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO

PROMPT = "What is the capital of France?"


def _cpu() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and of the children it has waited for
    (its finished compilers), read from /proc while it runs; 0 where there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def _default_sigint() -> None:
    # a background job of a non-interactive shell starts with SIGINT ignored, and so would the child
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def time_run(cmd: list[str], env: dict[str, str], skip_finish: bool = False) -> str:
    """``skip_finish``: ctrl+c (SIGINT) once `run` says it finishes the optimization, as a
    user in a hurry would (the answer is out; the compile would take minutes)."""
    cpu0, t0 = _children_cpu(), time.monotonic()
    p = subprocess.Popen([*cmd, "run", PROMPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         preexec_fn=_default_sigint)
    assert p.stdout is not None and p.stderr is not None
    finishing: list[float] = []

    def watch(stderr: IO[bytes]) -> None:
        for line in stderr:
            if b"finishing the optimization" in line and not finishing:
                finishing.append(time.monotonic() - t0)
                if skip_finish:
                    p.send_signal(signal.SIGINT)

    watcher = threading.Thread(target=watch, args=(p.stderr,), daemon=True)
    watcher.start()
    first = p.stdout.read(1)
    t_first = time.monotonic() - t0
    cpu_first = _process_cpu(p.pid)
    rest = p.stdout.read()
    code = p.wait()
    watcher.join(5)
    text = (first + rest).decode(errors="replace").strip()
    answered = f", answer out at {finishing[0]:.2f} s" if finishing else ""
    return (f"first token {t_first:.2f} s (cpu {cpu_first:.1f} s){answered}, exit {time.monotonic() - t0:.2f} s,"
            f" cpu {_children_cpu() - cpu0:.1f} s, rc {code}: {text[:60]!r}")


def time_serve(cmd: list[str], env: dict[str, str]) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cpu0, t0 = _children_cpu(), time.monotonic()
    p = subprocess.Popen([*cmd, "serve", "--chats", "16", "--port", str(port)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=env)
    ok = None
    while ok is None and p.poll() is None and time.monotonic() - t0 < 300:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    ok = time.monotonic() - t0
        except OSError:
            time.sleep(0.05)
    p.terminate()
    p.wait(60)
    health = f"{ok:.2f} s" if ok is not None else "never"
    return f"/health 200 at {health}, cpu to the stop {_children_cpu() - cpu0:.1f} s"


def time_chat(cmd: list[str], env: dict[str, str], limit_s: float = 300.0) -> str:
    """``localllm chat`` in a tmux terminal of its own (a server on its own socket, started
    with ``env``): seconds to the app's key bar (usable), the question typed then, and seconds
    to the reply's "Paris"; the CPU the app and its finished children had used by then. (Keys
    typed before the app has painted are lost: the terminal echoes them, the app never sees
    them.)"""
    tmux = shutil.which("tmux")
    if tmux is None:
        return "skipped: no tmux"
    sock = f"localllm-bench-{os.getpid()}"
    base = [tmux, "-L", sock]
    t0 = time.monotonic()
    subprocess.run([*base, "new-session", "-d", "-s", "chat", "-x", "120", "-y", "40", shlex.join([*cmd, "chat"])],
                   env=env, check=True)
    pid = int(subprocess.run([*base, "display", "-p", "-t", "chat", "#{pane_pid}"], env=env, capture_output=True,
                             text=True).stdout.strip() or 0)
    typed = usable = reply = None
    cpu = 0.0
    try:
        while reply is None and time.monotonic() - t0 < limit_s:
            now = time.monotonic() - t0
            screen = subprocess.run([*base, "capture-pane", "-p", "-t", "chat"], env=env, capture_output=True,
                                    text=True).stdout
            if usable is None and "^q Quit" in screen:
                usable = now
            if typed is None and usable is not None:
                subprocess.run([*base, "send-keys", "-t", "chat", "-l", PROMPT], env=env)
                subprocess.run([*base, "send-keys", "-t", "chat", "Enter"], env=env)
                typed = time.monotonic() - t0
            if "Paris" in screen:
                reply = time.monotonic() - t0
                cpu = _process_cpu(pid)
            time.sleep(0.05)
    finally:
        subprocess.run([*base, "kill-server"], env=env, capture_output=True)
    shown = f"{usable:.2f} s" if usable is not None else "never"
    answered = f"{reply:.2f} s (cpu {cpu:.1f} s)" if reply is not None else f"none in {limit_s:.0f} s"
    return f"usable at {shown}, question typed at {typed or 0:.2f} s, reply \"Paris\" at {answered}"


def fresh_env(base: dict[str, str], folder: Path) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in ("LOCALLLM_HOME", "LOCALLLM_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    for name in ("HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_CONFIG_HOME"):
        env[name] = str(folder / name.lower())
    models = Path(os.path.expanduser("~/.cache/localllm/models"))
    if not models.is_dir():
        sys.exit(f"no models folder at {models}: run one warm start first")
    shutil.copytree(models, folder / "xdg_cache_home" / "localllm" / "models")
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--cmd", default="localllm", help="the command that runs localllm (default: localllm)")
    ap.add_argument("--only", default="warm,fresh,serve", help="any of warm,fresh,serve,chat")
    ap.add_argument("--finish", action="store_true",
                    help="fresh: wait for the decode step's compile to end (minutes) instead of ctrl+c once answered")
    args = ap.parse_args()
    cmd = shlex.split(args.cmd)
    only = set(args.only.split(","))
    print(f"CPU: {_cpu()}, {os.cpu_count()} threads; load {os.getloadavg()[0]:.1f}", flush=True)
    for i in range(args.trials):
        if "warm" in only:
            print(f"warm  {i + 1}: {time_run(cmd, dict(os.environ))}", flush=True)
        if "serve" in only:
            print(f"serve {i + 1}: {time_serve(cmd, dict(os.environ))}", flush=True)
        if "fresh" in only:
            with tempfile.TemporaryDirectory(prefix="localllm-fresh-") as tmp:
                env = fresh_env(dict(os.environ), Path(tmp))
                print(f"fresh {i + 1}: {time_run(cmd, env, skip_finish=not args.finish)}", flush=True)
        if "chat" in only:
            with tempfile.TemporaryDirectory(prefix="localllm-fresh-") as tmp:
                env = fresh_env(dict(os.environ), Path(tmp))
                print(f"chat  {i + 1}: {time_chat(cmd, env)}", flush=True)
    print(f"load at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
