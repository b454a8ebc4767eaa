"""A compiled CPU kernel for the few-row fp32 products of decoding (``eagle/csrc/stream_linear.cpp``).

``stream_linear_op()`` builds it on first use with torch's C++ extension tools (a compiler and
ninja; about 25 s, once per machine and torch version, cached under ``$EAGLE_CACHE/extensions``)
on CPUs with AVX-512, and returns None elsewhere or when the build fails (the callers then use
oneDNN or ``F.linear``). ``eagle.lean.PackedLinear`` uses it for 1-16 rows."""

from __future__ import annotations

import functools
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Callable

import torch

SOURCE = Path(__file__).parent / "csrc" / "stream_linear.cpp"
STREAM_MAX_ROWS = 16  # the kernel's row limit (kMaxRows)
StreamOp = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def cpu_has_avx512() -> bool:
    """Whether torch's CPU dispatch found AVX-512 on this machine."""
    return "AVX512" in torch.backends.cpu.get_cpu_capability()


def _ninja_on_path() -> bool:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` package's copy is added when missing."""
    if shutil.which("ninja"):
        return True
    try:
        import ninja
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja") is not None


@functools.cache
def stream_linear_op() -> StreamOp | None:
    """``op(x [M, K], w [N, K], bias [N] | None) -> [M, N]`` for contiguous fp32 CPU tensors and
    1 <= M <= 16, or None where the kernel cannot run here (no AVX-512, no compiler or ninja)."""
    if not cpu_has_avx512():
        return None
    if not _ninja_on_path():
        warnings.warn("eagle: ninja not found; the streamed fp32 kernel is off (pip install ninja)")
        return None
    from torch.utils import cpp_extension

    from eagle.target import cache_root

    build = cache_root() / "extensions" / f"torch-{torch.__version__}"
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("eagle_stream_linear*.so")):
        print("eagle: compiling the streamed fp32 kernel (once per machine, about 25 s)", file=sys.stderr)
    try:
        module = cpp_extension.load(name="eagle_stream_linear", sources=[str(SOURCE)], build_directory=str(build),
                                    extra_cflags=["-O3", "-mavx512f", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                    verbose=False)
    except (OSError, RuntimeError, ImportError) as exc:
        warnings.warn(f"eagle: the streamed fp32 kernel did not build ({exc}); using oneDNN / F.linear")
        return None
    return module.stream_linear

