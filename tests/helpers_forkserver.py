"""Calls that must each run in a process of their own (a peak RSS, a tracer's state, a fake CUDA
device), without a fresh Python's imports per call: one server process imports what the calls need
once, then forks a child per call. Each child starts from what a just-started process holds after
those imports, measures, sends its result back and exits.

The server only imports before it forks: no torch op runs in it, so no thread pool (torch's
intra-op threads, tokenizers) is running there, whose locks a forked child could inherit held.
Nothing in this module imports torch: a server may have to set up the process before torch is
imported (the tracer's fake CUDA device)."""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SERVER_CODE = (
    f"import sys; sys.path[:0] = [{str(TESTS / 'unit')!r}, {str(TESTS)!r}, {str(REPO)!r}]; "
    "import helpers_forkserver; helpers_forkserver.serve(*sys.argv[1:])"
)


def _resolve(name: str) -> Callable:
    """'module:function' -> the function (tests/unit, tests and the repository on the path)."""
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


class ForkServer:
    """call(*args) in a child forked from one server process: the server first runs warm(*warm_args)
    (its imports) and imports call's module. Arguments and results travel as JSON; a child's
    pytest.skip skips the calling test, its exception fails it with the child's traceback. env is
    the server's environment (its children's too): pass what they rely on explicitly."""

    def __init__(
        self, call: str, warm: str = "", warm_args: list | None = None, env: dict | None = None, timeout: float = 900
    ):
        self.call, self.timeout = call, timeout
        argv = [sys.executable, "-c", SERVER_CODE, call, warm, json.dumps(warm_args or [])]
        # a session of its own: closing kills the server and a child still measuring, nothing else
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env, start_new_session=True
        )

    def __call__(self, *args: Any) -> Any:
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not ready:
            self.close()
            pytest.fail(f"{self.call}{args} ran past {self.timeout} s in its forked child")
        reply = json.loads(self.proc.stdout.readline() or '{"error": "the fork server ended (its stderr says why)"}')
        if "skip" in reply:
            pytest.skip(reply["skip"])
        assert "result" in reply, reply["error"][-3000:]
        return reply["result"]

    def close(self) -> None:
        if self.proc.poll() is None:  # idle between calls: nothing of its own to finish
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(call: str, warm: str, warm_args: str) -> None:
    """The server's loop: one JSON line of arguments in, a forked child calls, one JSON line out.
    Replies go out on the stdout it was started with; anything printed (by the server's imports or
    a child) goes to stderr instead."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    if warm:
        _resolve(warm)(*json.loads(warm_args))
    fn = _resolve(call)
    for line in sys.stdin:
        print(_forked(fn, json.loads(line)), file=replies, flush=True)


def _forked(fn: Callable, args: list) -> str:
    """fn(*args) in a forked child; its reply, one JSON line."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        with os.fdopen(write, "w") as f:
            f.write(_reply(fn, args))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        reply = f.read()
    _, status = os.waitpid(pid, 0)
    return reply or json.dumps({"error": f"the forked child ended with wait status {status}"})


def _reply(fn: Callable, args: list) -> str:
    try:
        return json.dumps({"result": fn(*args)})
    except pytest.skip.Exception as e:
        return json.dumps({"skip": str(e)})
    except BaseException:
        return json.dumps({"error": traceback.format_exc()})


# What a trace (bench/trace/child.py) imports inside the functions it runs: the tracer's server
# imports them once, before it forks (the model classes of the stacks the tests trace among them).
TRACE_IMPORTS = (
    "bench.trace.step",
    "bench.trace.model",
    "bench.trace.kernels",
    "bench.trace.tracker",
    "bench.trace.offload",
    "bench.trace.vision",
    "bitsandbytes.functional",
    "torch._subclasses.fake_tensor",
    "torch.distributed._tools.mem_tracker",
    "transformers.cache_utils",
    "transformers.generation.utils",
    "transformers.integrations.flex_attention",
    "transformers.masking_utils",
    "transformers.integrations.bitsandbytes",
    "transformers.quantizers.auto",
    "transformers.trainer",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "peft.tuners.lora.bnb",
    "trl.kernels.chunked_logprob",
    "trl.models.activation_offloading",
    "trl.trainer.sft_trainer",
    "trl.trainer.utils",
    "qlora_recipes.config.loader",
    "qlora_recipes.data.formats",
    "qlora_recipes.model.expert_lora",
    "qlora_recipes.model.loading",
    "qlora_recipes.planner",
    "qlora_recipes.run.trainer_args",
)


def warm_tracer(library: str) -> None:
    """A trace child's start (the fake CUDA device registered before torch) and its trace's imports."""
    from bench.trace import child

    child.prepare({"device": "cuda", "library": library})
    for name in TRACE_IMPORTS:
        importlib.import_module(name)


def trace_on_fake_cuda(spec: dict) -> dict:
    """bench/trace/child.py's trace of a spec on the fake CUDA device (the one the server has)."""
    from bench.trace import child

    if spec.get("device", "cuda") != "cuda" or not spec.get("fake", True):
        raise ValueError(f"the tracer's server has the fake CUDA device; trace {spec} with run_child")
    return child.trace(spec)


def tracer() -> ForkServer:
    """tracer()(spec): what run_child(spec) returns for a spec on the fake CUDA device, each trace in
    a child forked from one server (with run_child's environment) instead of a fresh Python."""
    from bench.trace import fakecuda
    from bench.trace.children import child_env

    library = str(fakecuda.build())
    return ForkServer("helpers_forkserver:trace_on_fake_cuda", "helpers_forkserver:warm_tracer", [library], child_env())
