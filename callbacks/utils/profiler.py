"""Quiet torch.profiler on a machine without CUDA: Kineto's known-harmless C++ lines, silenced at their source.

On a CPU-only machine every ``torch.profiler.profile`` session makes Kineto (the C++ tracer behind it)
print, straight to stderr::

    USDT:... SyncActivityProfilerHandler.cpp:39] profiler_start
    USDT:... SyncActivityProfilerHandler.cpp:46] profiler_stop
    ERROR:... DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35

The USDT lines are markers for tracing tools; the ERROR is Kineto asking the CUDA runtime for devices
while it builds the trace (35: cudaErrorInsufficientDriver, i.e. no GPU driver). Neither means anything
went wrong, and Python's logging cannot reach them. Kineto reads ``KINETO_LOG_LEVEL`` once, when the
first profiling session initialises it (levels 0 VERBOSE ... 4 ERROR, 5 USDT; 6 prints nothing): so
this sets 6 before that, and only where no CUDA device exists (Kineto then traces CPU operators only,
and has no GPU to report on) and the user has not chosen a level. No Lightning import.
"""

from __future__ import annotations

import os

#: Kineto's level above USDT (its ``ENUM_COUNT``): no Kineto line is printed.
KINETO_SILENT = "6"


def quiet_cpu_profiler() -> bool:
    """Call before the process's first ``torch.profiler.profile``; True if Kineto's lines were silenced."""
    import torch

    if "KINETO_LOG_LEVEL" in os.environ or torch.cuda.is_available():
        return False
    os.environ["KINETO_LOG_LEVEL"] = KINETO_SILENT
    return True
