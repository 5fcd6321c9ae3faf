"""replicas/cluster_launch.py (a pair_norm build launched through cuLaunchKernelEx, MK_CLUSTER_LAUNCH=ex; also
bench/cluster_probe.py's launches): its driver-API structures against cuda.h's layout (a wrong offset would pass
garbage to the driver on the device) and how it turns the monokernel's arguments into kernel parameters."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from replicas.cluster_launch import (LaunchAttribute, LaunchConfig, function_handle, kernel_param, launch_config,
                                     launch_mode)


def test_driver_structs_match_cuda_h():
    """CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union (72 bytes); CUlaunchConfig: seven
    uints, then hStream at 32, attrs at 40, numAttrs at 48."""
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert (LaunchConfig.hStream.offset, LaunchConfig.attrs.offset, LaunchConfig.numAttrs.offset) == (32, 40, 48)


def test_launch_config_sets_cooperative_and_cluster_attributes():
    cfg, attrs = launch_config(132, 512, 200 << 10, 0, cooperative=True, cluster=2)
    assert (cfg.numAttrs, cfg.gridDimX, cfg.blockDimX, cfg.sharedMemBytes) == (2, 132, 512, 200 << 10)
    assert attrs[0].id == 2 and bytes(attrs[0].value[:4]) == (1).to_bytes(4, "little")
    assert attrs[1].id == 4 and bytes(attrs[1].value[:12]) == b"".join(v.to_bytes(4, "little") for v in (2, 1, 1))
    cfg, _ = launch_config(132, 512, 0, 0, cooperative=True)  # (cluster shape compiled in: cooperative only)
    assert cfg.numAttrs == 1


def test_kernel_params_are_the_bytes_the_kernel_reads():
    block = np.arange(1, 6, dtype=np.uint64)
    by_value = block.view(np.dtype((np.void, block.nbytes)))[0]  # layout param_value's form
    assert bytes(kernel_param(by_value)) == block.tobytes()
    assert bytes(kernel_param(SimpleNamespace(data=SimpleNamespace(ptr=0xDEADBEEF000)))) == (0xDEADBEEF000).to_bytes(8, "little")
    assert bytes(kernel_param(np.int32(-3))) == (-3).to_bytes(4, "little", signed=True)
    with pytest.raises(TypeError, match="device array or a numpy void"):
        kernel_param(object())


def test_launch_mode_is_checked(monkeypatch):
    monkeypatch.delenv("MK_CLUSTER_LAUNCH", raising=False)
    assert launch_mode() == "cupy"
    monkeypatch.setenv("MK_CLUSTER_LAUNCH", "ex")
    assert launch_mode() == "ex"
    monkeypatch.setenv("MK_CLUSTER_LAUNCH", "driver")
    with pytest.raises(ValueError, match="choose one of cupy, ex"):
        launch_mode()


def test_function_handle_unwraps_a_raw_kernel():
    # RawModule.get_function gives a RawKernel (no .ptr; its .kernel holds the CUfunction): the probe's first
    # device run failed on exactly this
    raw_kernel = SimpleNamespace(kernel=SimpleNamespace(ptr=0x7F00_1234))
    assert function_handle(raw_kernel) == 0x7F00_1234
    assert function_handle(SimpleNamespace(ptr=0x55)) == 0x55
