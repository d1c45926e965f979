"""CuPy: only asked whether it holds a CUDA context (a :data:`~vgpu_magic.frameworks.CUDA_USERS` entry: nothing to
split, plan or launch). Imports no CuPy."""

from __future__ import annotations

import sys

from ..devices import Capabilities
from .base import CudaUser

__all__ = ["CuPy", "FRAMEWORK"]


class CuPy(CudaUser):
    capabilities = Capabilities(
        name="cupy", label="CuPy", splits_in_process=False, install_hint="install it with pip install cupy"
    )
    module = "cupy"

    def holds_cuda_context(self) -> bool:
        cupy = sys.modules.get("cupy")
        try:
            # The pool only holds bytes once CuPy has created a context.
            return bool(cupy is not None and cupy.get_default_memory_pool().total_bytes() > 0)
        except Exception:  # noqa: BLE001 - a broken CuPy holds no context we can see
            return False


FRAMEWORK = CuPy()
