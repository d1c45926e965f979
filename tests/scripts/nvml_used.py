"""What NVML counts for this process on the GPUs: its allocator's memory and its CUDA context, for the GPU
scripts beside this file to print (they import it from their own folder, as ``python``, ``torchrun`` and
``%vgpu_run`` let a script)."""

import os


def nvml_used() -> int | None:
    """This process's bytes in NVML's count of the compute processes, or ``None`` where it cannot be read."""
    used = None
    try:
        import pynvml

        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
                used = proc.usedGpuMemory if proc.pid == os.getpid() else used
    except Exception:  # noqa: BLE001 - no NVML, or PIDs from another namespace: the figure is left out
        pass
    return used
