"""Cooperative launches of a clustered monokernel through the driver's cuLaunchKernelEx (layout option pair_norm).

A pair_norm build has `__cluster_dims__(2, 1, 1)` compiled in and is normally launched the way every monokernel
is, by CuPy's cooperative launch. Whether the driver accepts a compiled-in cluster shape on that path is what
bench/cluster_probe.py checks on the device; where it does not, MK_CLUSTER_LAUNCH=ex makes load_module wrap the
kernel in `ExLaunch`, which launches it with the cooperative attribute through cuLaunchKernelEx (the cluster
shape stays the compiled one). The ctypes structures mirror cuda.h (tests/test_cluster_launch_cpu.py).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
LAUNCH_MODES = ("cupy", "ex")


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_ubyte * 64)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def launch_config(grid: int, threads: int, smem: int, stream: int, cooperative: bool, cluster: int = 1):
    """(config, attrs): keep `attrs` alive until the launch call returns. cluster > 1 sets the cluster shape at
    launch (for kernels without one compiled in)."""
    attrs = (LaunchAttribute * 2)()
    k = 0
    if cooperative:
        attrs[k].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        ctypes.memmove(attrs[k].value, ctypes.byref(ctypes.c_int(1)), 4)
        k += 1
    if cluster > 1:
        attrs[k].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        ctypes.memmove(attrs[k].value, (ctypes.c_uint * 3)(cluster, 1, 1), 12)
        k += 1
    return LaunchConfig(grid, 1, 1, threads, 1, 1, smem, stream, attrs, k), attrs


def launch_mode() -> str:
    mode = os.environ.get("MK_CLUSTER_LAUNCH", "cupy")
    if mode not in LAUNCH_MODES:
        raise ValueError(f"MK_CLUSTER_LAUNCH={mode!r}: choose one of {', '.join(LAUNCH_MODES)}")
    return mode


def kernel_param(arg) -> ctypes._SimpleCData | ctypes.Array:
    """One monokernel argument as the bytes cuLaunchKernelEx copies: a device array's pointer (the parameter
    block in device memory) or the parameter block itself by value (a numpy void scalar, layout param_value)."""
    if isinstance(arg, (np.void, np.integer)):  # (by value: the block, or a scalar of its own width)
        return (ctypes.c_ubyte * arg.nbytes).from_buffer_copy(arg.tobytes())
    data = getattr(arg, "data", None)
    if data is not None and hasattr(data, "ptr"):
        return ctypes.c_uint64(data.ptr)
    raise TypeError(f"cannot pass a {type(arg).__name__} to cuLaunchKernelEx: a device array or a numpy void "
                    "parameter block (param_value's host-pointer form is CuPy-only; unset MK_CLUSTER_LAUNCH)")


def function_handle(function) -> int:
    """The CUfunction behind a CuPy kernel: RawModule.get_function gives a RawKernel, whose `.kernel` is the
    cupy.cuda.function.Function that holds the driver handle."""
    return getattr(function, "kernel", function).ptr


class ExLaunch:
    """A CuPy kernel function launched cooperatively through cuLaunchKernelEx, called as CuPy's
    (grid, block, args, shared_mem=...) on the current stream. cluster > 1: the cluster shape set at launch
    (a kernel without one compiled in)."""

    def __init__(self, function, cluster: int = 1):
        self.function = function
        self.cluster = int(cluster)
        self._cuda = ctypes.CDLL("libcuda.so.1")

    def __getattr__(self, name):  # (max_dynamic_shared_size_bytes and the like: the wrapped function's)
        return getattr(self.function, name)

    def __setattr__(self, name, value):
        if name in ("function", "cluster", "_cuda"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.function, name, value)

    def __call__(self, grid, block, args, shared_mem: int = 0):
        import cupy as cp

        params = [kernel_param(a) for a in args]
        pointers = (ctypes.c_void_p * len(params))(*[ctypes.cast(ctypes.byref(p), ctypes.c_void_p) for p in params])
        cfg, attrs = launch_config(int(grid[0]), int(block[0]), int(shared_mem), cp.cuda.get_current_stream().ptr,
                                   cooperative=True, cluster=self.cluster)
        rc = self._cuda.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(function_handle(self.function)), pointers, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc} (grid {grid[0]} x {block[0]} threads, "
                               f"{shared_mem} bytes of shared memory, cooperative, clusters of "
                               f"{self.cluster if self.cluster > 1 else 'the compiled shape'})")
