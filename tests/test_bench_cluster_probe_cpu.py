"""bench/cluster_probe.py's driver-API structures against cuda.h's layout (a wrong offset would pass garbage to
cuLaunchKernelEx on the device): CUlaunchAttribute is 72 bytes (id, 4 bytes of padding, a 64-byte value union),
CUlaunchConfig has hStream at 32, attrs at 40 and numAttrs at 48."""

from __future__ import annotations

import ctypes

from bench.cluster_probe import LaunchAttribute, LaunchConfig, launch_config


def test_driver_structs_match_cuda_h():
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert (LaunchConfig.hStream.offset, LaunchConfig.attrs.offset, LaunchConfig.numAttrs.offset) == (32, 40, 48)


def test_launch_config_sets_cooperative_and_cluster_attributes():
    cfg, attrs = launch_config(132, 2, True, 0)
    assert cfg.numAttrs == 2 and cfg.gridDimX == 132 and cfg.blockDimX == 512
    assert attrs[0].id == 2 and bytes(attrs[0].value[:4]) == (1).to_bytes(4, "little")
    assert attrs[1].id == 4 and bytes(attrs[1].value[:12]) == b"".join(v.to_bytes(4, "little") for v in (2, 1, 1))
    cfg, _ = launch_config(132, 1, True, 0)
    assert cfg.numAttrs == 1
