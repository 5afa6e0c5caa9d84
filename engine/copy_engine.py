"""Pitched device-to-device copies on the GPU's copy engines (CUDA driver API).

Why: a streamed KV chunk is gathered out of the paged cache before it goes on
the wire, beside the forward's next layers. ``index_select`` does it with an SM
kernel that shares the SMs with those layers, so it slows the layers computing
beside it. Where the prompt's blocks are consecutive each K or V half of it is
one pitched copy (a row per layer, the layer's blocks' bytes), which the copy
engines move faster and with a fraction of that slowdown (they still share the
memory; docs/lab/2026-11-28-held-chunk-copy-engines.md). torch has no pitched
copy, so ``cuMemcpy2DAsync`` is called through ctypes; anything it refuses is
the caller's to copy another way. The driver takes pitches up to a limit (2 GiB
on current GPUs); a cache whose layer stride is over it (many blocks: a small
model's cache, a large GPU's) is copied a row, a layer, per call instead
(engine/kv_blocks.py).
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

_MEMORYTYPE_DEVICE = 2  # CU_MEMORYTYPE_DEVICE
_ATTRIBUTE_MAX_PITCH = 11  # CU_DEVICE_ATTRIBUTE_MAX_PITCH


class _Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D``, field for field."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


class CopyEngine:
    """The driver's pitched copy for one device (its ordinal), or ``None`` from
    ``load`` where the driver library is missing (a CPU host)."""

    def __init__(self, driver: ctypes.CDLL, device_index: int) -> None:
        self._copy = driver.cuMemcpy2DAsync_v2
        self._copy.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
        self._copy.restype = ctypes.c_int
        get_device, get_attribute = driver.cuDeviceGet, driver.cuDeviceGetAttribute
        get_device.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        get_attribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        get_device.restype = get_attribute.restype = ctypes.c_int
        device, pitch = ctypes.c_int(0), ctypes.c_int(0)
        status = get_device(ctypes.byref(device), device_index)
        if status == 0:
            status = get_attribute(ctypes.byref(pitch), _ATTRIBUTE_MAX_PITCH, device.value)
        if status != 0:
            raise OSError(
                f"the CUDA driver did not say device {device_index}'s pitch limit: {status}"
            )
        # A pitch over the device's limit is refused: a cache of many blocks has
        # a layer stride that large (then the caller copies a row at a time).
        self.max_pitch = pitch.value
        # The driver refused a copy: none is asked for again (``copy_2d``).
        self.refused = False
        self.gathers = 0  # KV gathers done by its copies (engine/kv_blocks.py counts them)

    @classmethod
    def load(cls, device_index: int) -> CopyEngine | None:
        """The copy engines of device ``device_index``; None where the driver
        cannot be asked (engine/kv_blocks.py's ``cache_copier`` says how a KV
        cache uses them)."""
        try:
            return cls(ctypes.CDLL("libcuda.so.1"), device_index)
        except (OSError, AttributeError) as e:
            logger.info("no copy-engine copies (%s): KV chunks are gathered by kernels", e)
            return None

    def copy_2d(
        self,
        dst: int,
        dst_pitch: int,
        src: int,
        src_pitch: int,
        width: int,
        height: int,
        stream: int,
    ) -> bool:
        """Queue ``height`` rows of ``width`` bytes, ``src_pitch`` apart at the
        device address ``src``, to ``dst`` (rows ``dst_pitch`` apart) on
        ``stream`` (its handle). False when the driver refused it (nothing was
        queued): a pitch over the limit, or a refusal by the driver, after
        which every copy is refused."""
        if self.refused or max(src_pitch, dst_pitch) > self.max_pitch:
            return False
        m = _Memcpy2D()
        m.srcMemoryType = m.dstMemoryType = _MEMORYTYPE_DEVICE
        m.srcDevice, m.srcPitch = src, src_pitch
        m.dstDevice, m.dstPitch = dst, dst_pitch
        m.WidthInBytes, m.Height = width, height
        status = self._copy(ctypes.byref(m), stream)
        if status != 0:
            # Not asked again: what the driver refused once (no context on this
            # thread, say) it would refuse for every chunk, each a log line.
            logger.warning(
                "cuMemcpy2DAsync refused a KV gather (CUresult %d): KV chunks are "
                "gathered by kernels from now on",
                status,
            )
            self.refused = True
        return status == 0
