"""A CUDA device for fake tensors on a CPU-only build of PyTorch, so the tracer runs every `cuda`
branch of torch, transformers, peft, TRL and bitsandbytes without a GPU.

A CPU-only build can make FakeTensors with device "cuda", but autograd asks the device's guard for
its current stream, and the engine asks the accelerator hooks whether CUDA exists: both are absent,
so the first backward aborts. Two registrations fill the gaps, from c10's own headers:
`c10::impl::FakeGuardImpl<CUDA>` (the device guard PyTorch ships for its tests: device index and
stream ids in a thread-local, events no-ops) and a `CUDAHooksInterface` that reports one device.
They live in a tiny C++ library (~20 lines, no Python bindings, built in ~5 s with
torch.utils.cpp_extension, cached per torch version). ATen creates its CUDA hooks once, at the first
question, and `import torch` asks it, so the library must be loaded before torch: `preload()` does
that with ctypes (libc10 and libtorch_cpu first, then the library, whose static initialisers
register both). A process that preloads it believes it has a CUDA device: the tracer runs it only
in a child process of its own (bench/trace/child.py), never in the harness or a test process.

Python-level CUDA calls (`torch.cuda.current_stream()`, `Stream`, `Event`, ...) still reach a runtime
that is not there; `runtime_shim()` answers the few the traced code makes (streams and events are
no-ops: they order work, they hold no memory; what their timing does to the caching allocator is an
allocator effect the tracer does not see).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
from pathlib import Path

SOURCE = r"""
// Fake CUDA device for FakeTensors on CPU-only PyTorch builds (bench/trace/fakecuda.py).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/FakeGuardImpl.h>

struct TraceFakeCUDAHooks final : public at::CUDAHooksInterface {
  explicit TraceFakeCUDAHooks(at::CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isAvailable() const override { return true; }
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  c10::DeviceIndex current_device() const override { return 0; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
  bool isPinnedPtr(const void*) const override { return false; }
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
};

namespace at {
using TraceFakeCUDAHooksImpl = ::TraceFakeCUDAHooks;
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", TraceFakeCUDAHooksImpl);
}

namespace {
struct RegisterGuard {
  RegisterGuard() {
    auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
    if (slot.load() == nullptr) {
      static c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> impl;
      slot.store(&impl);
    }
  }
} register_guard;
}

extern "C" int trace_fake_cuda_loaded() { return 1; }
"""

NAME = "qlora_trace_fake_cuda"


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("torch is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _torch_version() -> str:
    text = (_torch_dir() / "version.py").read_text()
    for line in text.splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("'\"")
    return "unknown"


def build_dir() -> Path:
    root = os.environ.get("QLORA_RECIPES_CACHE", str(Path.home() / ".cache" / "qlora-recipes"))
    return Path(root) / "trace" / f"fake-cuda-torch-{_torch_version()}"


def library_path() -> Path:
    return build_dir() / f"{NAME}.so"


def build(verbose: bool = False) -> Path:
    """The library, built if missing (imports torch: call it from a process that will not trace)."""
    path = library_path()
    if path.is_file():
        return path
    from torch.utils.cpp_extension import load

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    src = out / f"{NAME}.cpp"
    src.write_text(SOURCE)
    load(NAME, sources=[str(src)], is_python_module=False, build_directory=str(out), verbose=verbose)
    if not path.is_file():
        raise RuntimeError(f"building {path} left no library")
    return path


def preload(path: Path | None = None) -> None:
    """Register the fake CUDA device in this process. Must run before `import torch`."""
    import sys

    if "torch" in sys.modules:
        raise RuntimeError("fakecuda.preload() must run before torch is imported")
    lib = _torch_dir() / "lib"
    for name in ("libc10.so", "libtorch_cpu.so"):
        ctypes.CDLL(str(lib / name), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(path or library_path()), mode=ctypes.RTLD_GLOBAL)


class _Stream:
    """A CUDA stream that orders nothing (fake tensors run no kernels)."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        import torch

        self.device = torch.device("cuda", 0)

    def wait_stream(self, other) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def runtime_shim():
    """Python CUDA runtime calls the traced code makes, answered for one fake device. Streams and
    events order work and hold no memory; `record_stream` (TRL's activation offloading) only delays
    the caching allocator's reuse of a block, which the tracer does not model."""
    import torch

    default = _Stream()
    names = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "is_bf16_supported": lambda *a, **k: True,
        "synchronize": lambda *a, **k: None,
        "empty_cache": lambda: None,
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": lambda device=None: default,
        "default_stream": lambda device=None: default,
        "stream": lambda s=None: contextlib.nullcontext(s),
        "set_stream": lambda s: None,
    }
    saved = {k: getattr(torch.cuda, k, None) for k in names}
    saved_record = torch.Tensor.record_stream
    for k, v in names.items():
        setattr(torch.cuda, k, v)
    torch.Tensor.record_stream = lambda self, stream: None
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(torch.cuda, k, v)
        torch.Tensor.record_stream = saved_record
