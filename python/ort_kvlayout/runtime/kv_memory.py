"""Reserved address ranges whose physical memory is committed granule by granule.

Two backends with one interface (`Reservation`):

* `HostReservation`: an anonymous private mapping reserved with MAP_NORESERVE; a granule (a
  multiple of the page size) is committed by prefaulting it (madvise MADV_POPULATE_WRITE, or a
  write per page on kernels without it). `resident_bytes()` measures what the kernel has really
  committed (mincore), independently of the accounting kept here.
* `DeviceReservation`: CUDA virtual memory through the native module (`_C.VmmReservation`:
  cuMemAddressReserve, then per granule cuMemCreate + cuMemMap, and one cuMemSetAccess per run
  of consecutive granules). The address range is fixed for the reservation's life: committing
  more never moves a byte.

Both round committed ranges to their granule, skip granules already committed, count what they
hold in process-wide totals (`allocator_stats()`; back to zero once every reservation is closed)
and release everything on close(). A failed commit raises `KvMemoryError` and leaves the
reservation valid with the granules committed before it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
from typing import Protocol

import numpy as np

__all__ = [
    "DeviceReservation",
    "HostReservation",
    "KvMemoryError",
    "OrtDeviceBuffer",
    "Reservation",
    "allocator_stats",
    "driver_times",
    "granule_runs",
    "simulate_commit_failure",
]


class KvMemoryError(MemoryError):
    """Reserving or committing KV-cache memory failed; the message names the call and the error."""


class Reservation(Protocol):
    device: str  # "cpu" or "cuda"
    ptr: int  # base address, fixed for the reservation's life
    size: int  # reserved bytes (a multiple of granule)
    granule: int

    def commit(self, offset: int, size: int) -> int:
        """Commits the granules covering [offset, offset+size); returns the bytes newly committed."""
        ...

    def decommit(self, offset: int, size: int) -> int:
        """Returns the granules inside [offset, offset+size) (granule aligned) to the system;
        returns the bytes released. The range stays reserved: a later commit maps it again."""
        ...

    @property
    def committed_bytes(self) -> int: ...

    def read(self, offset: int, size: int) -> bytes: ...

    def write(self, offset: int, data: bytes) -> None: ...

    def copy_from(self, offset: int, src: Reservation, src_offset: int, size: int) -> None: ...

    def close(self) -> None: ...


def granule_runs(ranges: list[tuple[int, int]], granule: int) -> list[tuple[int, int]]:
    """Byte ranges [start, end) -> (offset, size) runs of whole granules covering them, merged."""
    runs: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if end <= start:
            continue
        lo = start // granule * granule
        hi = -(-end // granule) * granule
        if runs and lo <= runs[-1][0] + runs[-1][1]:
            first = runs[-1][0]
            runs[-1] = (first, max(runs[-1][0] + runs[-1][1], hi) - first)
        else:
            runs.append((lo, hi - lo))
    return runs


def _round_up(n: int, granule: int) -> int:
    return -(-n // granule) * granule


# ---------------------------------------------------------------------------------------------
# Process-wide accounting (host side; the device side is counted in _C)

_lock = threading.Lock()
_host = {"reservations": 0, "reserved_bytes": 0, "committed_bytes": 0}
_ort_device = {"reservations": 0, "reserved_bytes": 0, "committed_bytes": 0}
_fail_host_commits_after: int | None = None


def allocator_stats() -> dict[str, dict[str, int]]:
    """Live reservations, reserved and committed bytes: "cpu" (host mappings), "cuda" (CUDA
    virtual memory, counted in _C; only in CUDA builds), "cuda_ort" (OrtDeviceBuffer)."""
    with _lock:
        stats = {"cpu": dict(_host)}
        stats["cuda_ort"] = dict(_ort_device)
    cuda = _cuda_module(required=False)
    if cuda is not None:
        stats["cuda"] = dict(cuda.vmm_stats())
    return stats


def driver_times() -> dict[str, dict[str, int]]:
    """Cumulative calls and wall nanoseconds of the CUDA driver's memory calls that device
    reservations made (cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease and the
    cuCtxSynchronize before an unmap) since the process began: {name: {"calls", "ns"}}. Empty
    without a CUDA build. Subtract two readings to time a span of work."""
    cuda = _cuda_module(required=False)
    if cuda is None:
        return {}
    return {name: dict(t) for name, t in cuda.vmm_driver_times().items()}


def simulate_commit_failure(device: str, after: int = 0) -> None:
    """Test hook: the commit of the (after+1)-th next granule on `device` fails as if the
    physical allocation had failed (host: ENOMEM; CUDA: cuMemCreate's CUDA_ERROR_OUT_OF_MEMORY).
    after < 0 clears the hook."""
    global _fail_host_commits_after
    if device == "cpu":
        with _lock:
            _fail_host_commits_after = None if after < 0 else after
    else:
        _cuda_module(required=True).vmm_fail_after(after)


# ---------------------------------------------------------------------------------------------
# Host: an anonymous MAP_NORESERVE mapping

_PROT_READ, _PROT_WRITE = 0x1, 0x2
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x02, 0x20, 0x4000
_MADV_DONTNEED = 4
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_PAGE = mmap.PAGESIZE
_libc = None
_populate_supported = True


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_long,
        ]  # fmt: skip
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = libc
    return _libc


def _os_error(call: str) -> KvMemoryError:
    code = ctypes.get_errno()
    return KvMemoryError(f"{call} failed: {errno.errorcode.get(code, code)} ({os.strerror(code)})")


def host_total_bytes() -> int | None:
    """The machine's physical memory (sysconf), or None where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no such name, or no sysconf at all
        return None


class HostReservation:
    """`size` bytes of address space; granules (multiples of the page size) committed on demand."""

    device = "cpu"

    def __init__(self, size: int, granule: int = _PAGE):
        if granule <= 0 or granule % _PAGE:
            raise ValueError(f"granule must be a positive multiple of the page size {_PAGE}")
        if size <= 0:
            raise ValueError(f"reservation size must be positive, got {size}")
        memory = host_total_bytes()
        if memory is not None and granule > memory:  # its first commit would exhaust the host
            raise ValueError(
                f"granule of {granule} bytes is more than this machine's memory ({memory} bytes)"
            )
        self.granule = granule
        self.size = _round_up(size, granule)
        addr = _lib().mmap(
            None, self.size, _PROT_READ | _PROT_WRITE,
            _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0,
        )  # fmt: skip
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise _os_error(f"mmap({self.size} bytes, MAP_NORESERVE)")
        self.ptr: int = addr
        self._committed = bytearray(self.size // granule)  # 1 per committed granule
        self._committed_bytes = 0
        with _lock:
            _host["reservations"] += 1
            _host["reserved_bytes"] += self.size

    @property
    def committed_bytes(self) -> int:
        return self._committed_bytes

    @property
    def closed(self) -> bool:
        return self.ptr == 0

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("the reservation is closed")

    def commit(self, offset: int, size: int) -> int:
        self._check_open()
        if offset < 0 or offset + size > self.size:
            raise ValueError(f"commit [{offset}, {offset + size}) outside the {self.size} reserved")
        committed = self._committed
        added = 0
        for run_offset, run_size in granule_runs([(offset, offset + size)], self.granule):
            g, end = run_offset // self.granule, (run_offset + run_size) // self.granule
            while g < end:  # consecutive missing granules are committed by one call
                if committed[g]:
                    g += 1
                    continue
                first = g
                while g < end and not committed[g]:
                    g += 1
                self._commit_granules(first, g - first)
                added += (g - first) * self.granule
        return added

    def _commit_granules(self, first: int, count: int) -> None:
        global _fail_host_commits_after, _populate_supported
        with _lock:
            armed = _fail_host_commits_after
            if armed is not None and armed < count:
                _fail_host_commits_after = None
            elif armed is not None:
                _fail_host_commits_after = armed - count
        if armed is not None and armed < count:
            if armed:
                self._commit_granules(first, armed)  # the granules before the failing one
            raise KvMemoryError(
                f"committing {self.granule} bytes of host memory failed: ENOMEM "
                "(simulated by simulate_commit_failure)"
            )
        addr, size = self.ptr + first * self.granule, count * self.granule
        if _populate_supported and _lib().madvise(addr, size, _MADV_POPULATE_WRITE) != 0:
            if ctypes.get_errno() != errno.EINVAL:
                raise _os_error(f"madvise(MADV_POPULATE_WRITE, {size} bytes)")
            _populate_supported = False  # kernel < 5.14: fault the pages in by writing
        if not _populate_supported:
            pages = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))
            pages[::_PAGE] = pages[::_PAGE]  # a write per page: the kernel commits it
        self._committed[first : first + count] = b"\x01" * count
        self._committed_bytes += size
        with _lock:
            _host["committed_bytes"] += size

    def decommit(self, offset: int, size: int) -> int:
        self._check_open()
        if offset % self.granule or size % self.granule or offset < 0 or offset + size > self.size:
            raise ValueError(f"decommit [{offset}, +{size}) is not granule aligned in the range")
        committed = self._committed
        released = 0
        g, end = offset // self.granule, (offset + size) // self.granule
        while g < end:  # consecutive committed granules are released by one call
            if not committed[g]:
                g += 1
                continue
            first = g
            while g < end and committed[g]:
                g += 1
            addr, nbytes = self.ptr + first * self.granule, (g - first) * self.granule
            # A private anonymous mapping: the pages go back to the kernel and read as zeros when
            # touched again (MAP_NORESERVE keeps them out of the commit charge until then).
            if _lib().madvise(addr, nbytes, _MADV_DONTNEED) != 0:
                raise _os_error(f"madvise(MADV_DONTNEED, {nbytes} bytes)")
            committed[first:g] = bytes(g - first)
            released += nbytes
        self._committed_bytes -= released
        with _lock:
            _host["committed_bytes"] -= released
        return released

    def resident_bytes(self) -> int:
        """Bytes the kernel holds for this range (mincore), measured, not taken from accounting."""
        self._check_open()
        pages = self.size // _PAGE
        vec = (ctypes.c_ubyte * pages)()
        if _lib().mincore(self.ptr, self.size, vec) != 0:
            raise _os_error("mincore")
        return int(np.count_nonzero(np.frombuffer(vec, np.uint8) & 1)) * _PAGE

    def check_mapped(self, offset: int, size: int) -> None:
        """Raises ValueError unless [offset, offset+size) lies in the reservation's committed
        granules (the device reservation's CheckMapped rule): past the mapping a memmove would
        fault, and into an uncommitted granule it would commit memory behind the accounting."""
        self._check_open()
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError(
                f"range [{offset}, +{size}) outside the reservation of {self.size} bytes"
            )
        if size:
            first, last = offset // self.granule, (offset + size - 1) // self.granule
            if not all(self._committed[first : last + 1]):
                raise ValueError(f"range [{offset}, +{size}) touches an uncommitted granule")

    def view(self, offset: int = 0, size: int | None = None) -> np.ndarray:
        """A uint8 numpy view of a committed range (valid until close(); do not keep it)."""
        size = self.size - offset if size is None else size
        self.check_mapped(offset, size)
        return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(self.ptr + offset))

    def read(self, offset: int, size: int) -> bytes:
        return self.view(offset, size).tobytes()

    def write(self, offset: int, data: bytes) -> None:
        self.check_mapped(offset, len(data))
        ctypes.memmove(self.ptr + offset, data, len(data))

    def copy_from(self, offset: int, src: Reservation, src_offset: int, size: int) -> None:
        if not isinstance(src, HostReservation):
            raise TypeError("HostReservation.copy_from needs a host source")
        self.check_mapped(offset, size)
        src.check_mapped(src_offset, size)
        ctypes.memmove(self.ptr + offset, src.ptr + src_offset, size)

    def close(self) -> None:
        if self.closed:
            return
        if _lib().munmap(self.ptr, self.size) != 0:
            raise _os_error("munmap")
        with _lock:
            _host["reservations"] -= 1
            _host["reserved_bytes"] -= self.size
            _host["committed_bytes"] -= self._committed_bytes
        self.ptr = 0
        self._committed_bytes = 0

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nobody to report to
            self.close()


# ---------------------------------------------------------------------------------------------
# Device: CUDA virtual memory through _C


def _cuda_module(required: bool):
    try:
        from .. import _C
    except ImportError as exc:
        if required:
            raise KvMemoryError(f"the native module ort_kvlayout._C is not built: {exc}") from exc
        return None
    if not hasattr(_C, "VmmReservation"):
        if required:
            raise KvMemoryError(
                "ort_kvlayout._C was built without CUDA (no VmmReservation): reinstall with the "
                "CUDA toolkit present to use device KV caches"
            )
        return None
    return _C


class DeviceReservation:
    """CUDA virtual memory: a fixed address range, physical granules mapped on demand."""

    device = "cuda"

    def __init__(self, size: int, device_id: int = 0):
        c = _cuda_module(required=True)
        self._c = c
        try:
            self._vmm = c.VmmReservation(int(device_id), int(size))
        except c.CudaError as exc:
            raise KvMemoryError(str(exc)) from exc
        self.device_id = device_id
        self.ptr: int = self._vmm.ptr
        self.size: int = self._vmm.size
        self.granule: int = self._vmm.granularity

    @property
    def committed_bytes(self) -> int:
        return self._vmm.mapped_bytes

    @property
    def closed(self) -> bool:
        return self._vmm.closed

    def commit(self, offset: int, size: int) -> int:
        added = 0
        for run_offset, run_size in granule_runs([(offset, offset + size)], self.granule):
            try:
                added += self._vmm.map(run_offset, run_size)
            except self._c.CudaError as exc:
                raise KvMemoryError(str(exc)) from exc
        return added

    def decommit(self, offset: int, size: int) -> int:
        """Unmaps and releases the granules of [offset, offset+size) (waits for the device)."""
        before = self._vmm.mapped_bytes
        try:
            self._vmm.unmap(offset, size)
        except self._c.CudaError as exc:
            raise KvMemoryError(str(exc)) from exc
        return before - self._vmm.mapped_bytes

    def resident_bytes(self) -> int:
        """Mapped physical bytes (counted by the allocator per cuMemCreate'd granule)."""
        return self._vmm.mapped_bytes

    def read(self, offset: int, size: int) -> bytes:
        return self._vmm.copy_to_host(offset, size)

    def write(self, offset: int, data: bytes) -> None:
        self._vmm.copy_from_host(offset, data)

    def copy_from(self, offset: int, src: Reservation, src_offset: int, size: int) -> None:
        if src.device != "cuda":
            raise ValueError("DeviceReservation.copy_from needs a device source")
        self._c.cuda_copy(self.ptr + offset, src.ptr + src_offset, size, self.device_id)

    def close(self) -> None:
        self._vmm.close()


class OrtDeviceBuffer:
    """A plain device allocation from onnxruntime's CUDA allocator, committed whole: what
    onnxruntime-genai binds (the preallocated mode) and what a bucket runtime reallocates. On
    release the bytes go back to ORT's arena, as in those runtimes."""

    device = "cuda"
    granule = 1

    def __init__(self, size: int, device_id: int = 0):
        import onnxruntime as ort

        if size <= 0:
            raise ValueError(f"buffer size must be positive, got {size}")
        uint8 = 2  # onnx TensorProto.UINT8
        try:
            self._value = ort.OrtValue.ortvalue_from_shape_and_type(
                [size], uint8, "cuda", device_id
            )
        except Exception as exc:  # ORT raises RuntimeError or its own exception types
            raise KvMemoryError(
                f"allocating {size} bytes on cuda:{device_id} failed: {exc}"
            ) from exc
        self.ptr: int = self._value.data_ptr()
        self.size = size
        self.device_id = device_id
        with _lock:
            _ort_device["reservations"] += 1
            _ort_device["reserved_bytes"] += size
            _ort_device["committed_bytes"] += size

    @property
    def committed_bytes(self) -> int:
        return self.size if self._value is not None else 0

    @property
    def closed(self) -> bool:
        return self._value is None

    def commit(self, offset: int, size: int) -> int:
        if self.closed:
            raise ValueError("the buffer is closed")
        return 0  # allocated whole

    def decommit(self, offset: int, size: int) -> int:
        return 0  # allocated whole: nothing goes back before close()

    def resident_bytes(self) -> int:
        return self.committed_bytes

    def read(self, offset: int, size: int) -> bytes:
        return self._value.numpy()[offset : offset + size].tobytes()

    def write(self, offset: int, data: bytes) -> None:
        host = self._value.numpy()
        host[offset : offset + len(data)] = np.frombuffer(data, np.uint8)
        self._value.update_inplace(host)

    def copy_from(self, offset: int, src: Reservation, src_offset: int, size: int) -> None:
        if src.device != "cuda":
            raise ValueError("OrtDeviceBuffer.copy_from needs a device source")
        _cuda_module(required=True).cuda_copy(
            self.ptr + offset, src.ptr + src_offset, size, self.device_id
        )

    def close(self) -> None:
        if self._value is None:
            return
        self._value = None
        with _lock:
            _ort_device["reservations"] -= 1
            _ort_device["reserved_bytes"] -= self.size
            _ort_device["committed_bytes"] -= self.size
