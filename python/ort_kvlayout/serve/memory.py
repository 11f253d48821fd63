"""The engine's KV budget: bytes, or a fraction of the memory free when the engine starts.

    free, total = device_memory("cuda", 0)        # cuMemGetInfo on the device's primary context
    budget = resolve_kv_budget(None, 0.9, free, total, "cuda:0")

`device_memory` asks the CUDA driver (libcuda.so.1 through ctypes: cuMemGetInfo on the
device's primary context, the one onnxruntime's CUDA EP and the VMM cache use) or, on the CPU,
/proc/meminfo (MemAvailable, MemTotal). `resolve_kv_budget` is the pure rule: a fraction of the
free bytes, and bytes given outright refused when they exceed what the device has.
"""

from __future__ import annotations

import ctypes

from ..runtime.kv_memory import host_total_bytes

__all__ = ["DEFAULT_CUDA_FRACTION", "device_memory", "resolve_kv_budget"]

# The default budget on CUDA: this share of the device memory free once the model is loaded
# (the rest is left to activations, CUDA graphs and onnxruntime's arena).
DEFAULT_CUDA_FRACTION = 0.9


def _cuda_memory(device_id: int) -> tuple[int, int]:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise RuntimeError(f"cannot load the CUDA driver libcuda.so.1: {exc}") from exc

    def check(rc: int, call: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{call} failed: {(name.value or b'CUDA error').decode()} ({rc})")

    device = ctypes.c_int()
    context = ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(lib.cuInit(0), "cuInit")
    check(lib.cuDeviceGet(ctypes.byref(device), int(device_id)), f"cuDeviceGet({device_id})")
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    try:
        check(lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            check(lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        finally:
            popped = ctypes.c_void_p()
            lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
    finally:
        lib.cuDevicePrimaryCtxRelease_v2(device)
    return free.value, total.value


def _host_memory() -> tuple[int | None, int | None]:
    values = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total = values.get("MemTotal")
    return values.get("MemAvailable"), total if total is not None else host_total_bytes()


def device_memory(provider: str, device_id: int = 0) -> tuple[int | None, int | None]:
    """(free, total) bytes of the device the KV cache lives on: the CUDA device's (the driver's
    cuMemGetInfo: what the whole device has free now, other processes included), or the host's
    (MemAvailable, MemTotal); None where it cannot be read. CUDA errors raise RuntimeError."""
    if provider == "cuda":
        return _cuda_memory(device_id)
    return _host_memory()


def resolve_kv_budget(
    budget_bytes: int | None,
    fraction: float | None,
    free: int | None,
    total: int | None,
    device: str,
    default_fraction: float | None = None,
) -> int | None:
    """The KV budget in bytes, or None (no limit: the engine then commits up to its reservation).

    budget_bytes: refused (ValueError) when more than the device's total memory, or, on a device
    that does not overcommit (CUDA: `default_fraction` set), more than the free memory;
    fraction (0 < f <= 1): that share of the free memory; neither: `default_fraction` of the
    free memory (CUDA), or None (host)."""
    if budget_bytes is not None and fraction is not None:
        raise ValueError("give the KV budget as bytes or as a fraction of free memory, not both")
    if fraction is None and budget_bytes is None:
        fraction = default_fraction
        if fraction is None:
            return None
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise ValueError(f"the KV budget fraction must be in (0, 1], got {fraction}")
        if free is None:
            raise ValueError(
                f"cannot read the free memory of {device}: give the KV budget in bytes"
            )
        budget = int(fraction * free)
        if budget < 1:
            raise ValueError(
                f"{device} has no free memory for a KV cache ({free} bytes free)"
                if free < 1
                else f"a KV budget fraction of {fraction} of the {free} bytes free on {device} "
                "is less than one byte"
            )
        return budget
    assert budget_bytes is not None
    if budget_bytes < 1:
        raise ValueError(f"the KV budget must be >= 1 byte, got {budget_bytes}")
    where = "this machine's memory" if device == "cpu" else f"{device}'s memory"
    if total is not None and budget_bytes > total:
        raise ValueError(
            f"the KV budget of {budget_bytes} bytes is more than {where} ({total} bytes)"
        )
    if default_fraction is not None and free is not None and budget_bytes > free:
        raise ValueError(
            f"the KV budget of {budget_bytes} bytes is more than the {free} bytes free on "
            f"{device} once the model is loaded ({total} bytes in all)"
        )
    return budget_bytes
