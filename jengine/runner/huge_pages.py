"""Weights on CPU backed by transparent huge pages.

Where it sits: the model runner calls `back_with_huge_pages(params)` once the weights are
on a CPU device (at start-up, and after `update_weights` swaps them). It changes where the
weights' memory is mapped, never their contents, and never raises.

Why: a single-stream decode step reads every weight once (160 MB on the benchmark model),
and with 4 KiB pages that is ~40,000 TLB misses a step, each a page-table walk that the
streaming loads wait on. Linux usually gives huge pages only to memory that asks
(`/sys/kernel/mm/transparent_hugepage/enabled` = madvise), and XLA's allocator does not
ask. `MADV_COLLAPSE` (Linux 6.1+) turns the 2 MiB-aligned inside of each weight buffer
into huge pages in place, synchronously; `MADV_HUGEPAGE` keeps them so. Measured on the
56M benchmark model (bench/README.md, "Huge pages"): decode 8-10% faster, 0.1-0.5 s at
start-up. Where the kernel refuses (an older kernel, THP "never", another OS), the weights
stay as they were, and a debug line says so.
"""

import ctypes
import logging
import sys

import jax

logger = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE_BYTES = 2 << 20


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def huge_page_span(pointer: int, num_bytes: int) -> tuple[int, int] | None:
    """The 2 MiB-aligned [start, end) inside a buffer, or None when it holds no whole huge
    page: only memory the buffer owns is advised."""
    start = -(-pointer // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (pointer + num_bytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return (start, end) if end > start else None


def back_with_huge_pages(tree) -> int:
    """Collapse the CPU buffers of `tree`'s arrays into huge pages; returns the bytes now
    in huge pages (0 where the kernel refused or nothing was on a CPU)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    collapsed = 0
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            if shard.device.platform != "cpu":
                return collapsed
            span = huge_page_span(shard.data.unsafe_buffer_pointer(), shard.data.nbytes)
            if span is None:
                continue
            start, end = span
            for advice in (MADV_HUGEPAGE, MADV_COLLAPSE):
                if madvise(start, end - start, advice) != 0:
                    logger.debug(
                        "weights stay in 4 KiB pages: madvise(%d) failed with errno %d",
                        advice,
                        ctypes.get_errno(),
                    )
                    return collapsed
            collapsed += end - start
    return collapsed
