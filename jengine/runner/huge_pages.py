"""The weights' and the KV cache's host memory in 2 MiB pages, on CPU devices under Linux.

Where it sits: `ModelRunner` (and a draft model) call `move_to_huge_pages(params)` once the
weights are on their devices, at start and after `update_weights`: a thread moves them
while warmup compiles (it copies memory: 0.1-0.8 s for the 56M benchmark model's 200 MB
on a 2-core VM, seconds for larger models) and logs its report when done. They call
`zeros_in_huge_pages(kv_cache)` right after making the cache, before any step writes it.

Why: a single-stream decode step on a CPU is one stream through every weight. In 4 KiB
pages that stream crosses a page every 64 cache lines: a TLB miss and a hardware
prefetcher that starts over at each boundary. The same reads from 2 MiB pages ran 1.15x
faster in a two-thread C++ stream, and the 56M benchmark model decoded 1.06x faster (the
median of 24 paired runs; bench/README.md, "Weights in 2 MiB pages"). XLA's allocator hands out
ordinary pages, and Linux's default transparent-huge-page setting ("madvise") backs only
memory that asks, so the weights ask here, after the fact: `MADV_COLLAPSE` (Linux 6.1)
copies a range's small pages into huge ones in place, values and addresses unchanged.
Attention's walks read each request's pages of the KV cache, 4 KiB of one kv head at a
time, scattered over the whole cache: the 56M benchmark model's decode attention at 128
requests of 224 tokens took 0.79x the time on a cache in 2 MiB pages (bench/README.md, "An
AVX-512 EPYC again, and the KV cache in 2 MiB pages"). The cache is zeros when made, so it
needs no copy: its small pages are given back and each 2 MiB is faulted in whole when
first written.

Promises:
- only buffers on CPU devices are touched, and of each only the whole 2 MiB pages that lie
  inside it: memory around a buffer, which the allocator may hand to something else, is
  never advised; weights are not remapped (`MADV_COLLAPSE` changes no mapping's flags),
  the cache's pages are marked `MADV_HUGEPAGE` (their mapping is split off);
- never raises: an older kernel, transparent huge pages set to "never", another OS or a
  refused collapse leave the pages as they were, and the report says why;
- the steps may run meanwhile: a collapse keeps the values, and a page being moved is
  only waited on for the copy; the cache, advised before any step, reads as the zeros it
  was made of;
- `JENGINE_HUGE_PAGES=0` turns it off (a baseline for benchmarks, or a kernel that
  misbehaves).
"""

import ctypes
import errno
import functools
import logging
import os
import re
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import jax

# include/uapi/asm-generic/mman-common.h
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # Linux 6.1
THP_DIR = "/sys/kernel/mm/transparent_hugepage"
DEFAULT_HUGE_PAGE = 2 << 20  # x86-64's PMD size; arm64 with 4 KiB base pages too
SWITCH = "JENGINE_HUGE_PAGES"
TRIES = 4  # passes over the ranges the kernel refused
RETRY_PAUSE_S = 0.05

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HugePageReport:
    """What `back_with_huge_pages` did: bytes moved into huge pages of the CPU buffers'
    whole pages, and why not all of them, if not."""

    collapsed_bytes: int = 0
    eligible_bytes: int = 0
    seconds: float = 0.0
    reason: str | None = None
    # Pages of a buffer that lie across two of the process's mappings: a huge page must lie
    # in one, so these stay small (the cold test suite saw one such page in SmolLM2's
    # weights, at the end of the [heap]).
    split_bytes: int = 0
    what: str = "weights"

    def describe(self) -> str:
        if self.eligible_bytes == 0 and self.reason is None:
            return ""  # no CPU buffers: nothing to say
        text = f"{self.collapsed_bytes / 2**20:.0f} MiB of {self.what} in huge pages"
        if self.collapsed_bytes:
            text += f" ({self.seconds:.2f} s)"
        return text + (f"; {self.reason}" if self.reason else "")


def move_to_huge_pages(tree) -> "Future[HugePageReport]":
    """`back_with_huge_pages(tree)` on a thread of its own (the arrays stay referenced
    until it is done); the report is logged when there is one to give."""
    future: Future[HugePageReport] = Future()

    def move():
        try:
            report = back_with_huge_pages(tree)
        except BaseException as error:  # never expected (see the promises): kept, not lost
            future.set_exception(error)
            raise
        if report.describe():
            logger.info(report.describe())
        future.set_result(report)

    threading.Thread(target=move, name="jengine-huge-pages", daemon=True).start()
    return future


def zeros_in_huge_pages(cache: jax.Array) -> HugePageReport:
    """Put a buffer of zeros that no step has read or written yet (the KV cache, just
    made) into huge pages without copying it: its whole pages marked `MADV_HUGEPAGE`, then
    their small pages given back (`MADV_DONTNEED`: the range reads as zeros again), so
    each 2 MiB is faulted in as one huge page when a step first writes it. Takes
    milliseconds; the part of a cache no request reaches holds no memory. Logs the report."""
    ranges = _whole_pages(cache)
    eligible = sum(length for _, length in ranges)
    reason = _unavailable() if ranges else None
    advised, started = 0, time.perf_counter()
    if ranges and reason is None:
        madvise = _madvise()
        for start, length in ranges:
            # Given back only once marked: small pages written again would stay small.
            if madvise(start, length, MADV_HUGEPAGE) or madvise(start, length, MADV_DONTNEED):
                reason = f"madvise refused ({errno.errorcode.get(ctypes.get_errno(), '?')})"
                break
            advised += length
    report = HugePageReport(
        advised, eligible, time.perf_counter() - started, reason, what="the KV cache"
    )
    if report.describe():
        logger.info(report.describe())
    return report


def back_with_huge_pages(tree) -> HugePageReport:
    """Move every CPU-device buffer of `tree` (a pytree of jax arrays) into huge pages,
    where the kernel lets it; see the module's promises."""
    ranges = _whole_pages(tree)
    eligible = sum(length for _, length in ranges)
    if not ranges:
        return HugePageReport()
    reason = _unavailable()
    if reason is not None:
        return HugePageReport(eligible_bytes=eligible, reason=reason)
    madvise = _madvise()
    huge_page = huge_page_size()
    # One call per huge page: for a range the kernel answers one error if any page failed,
    # and it stops at some refusals (mm/khugepaged.c, madvise_collapse), leaving the
    # pages after it small. Per page, the others still move and the report is exact.
    pages = [start + offset for start, length in ranges for offset in range(0, length, huge_page)]
    started = time.perf_counter()
    collapsed, failed, split, mappings = 0, [], [], None
    for attempt in range(TRIES):
        # The kernel refuses a page that is busy elsewhere for a moment (EAGAIN: not yet
        # on its LRU lists); a later pass moves it. A kernel without MADV_COLLAPSE says
        # EINVAL every pass: 0.3 s.
        if attempt:
            time.sleep(RETRY_PAUSE_S * attempt)
        failed = []
        for page in pages:
            if madvise(page, huge_page, MADV_COLLAPSE) == 0:
                collapsed += huge_page
            else:
                failed.append((page, ctypes.get_errno()))
        if failed and mappings is None:  # pages across two mappings are never asked again
            mappings = _mappings()
            split = [page for page, _ in failed if _across(page, huge_page, mappings)]
            failed = [(page, code) for page, code in failed if page not in split]
        if not failed:
            break
        pages = [page for page, _ in failed]
    seconds = time.perf_counter() - started
    reasons = []
    if failed and collapsed == 0 and all(code == errno.EINVAL for _, code in failed):
        reasons.append("the kernel refused MADV_COLLAPSE (Linux 6.1 or newer has it)")
    elif failed:
        reasons.append(_refusals(failed, huge_page, mappings))
    if split:
        reasons.append(
            f"{_pages(len(split), huge_page)} lie across two mappings (a huge page must lie in one)"
        )
    reason = "; ".join(reasons) or None
    return HugePageReport(collapsed, eligible, seconds, reason, len(split) * huge_page)


def _pages(count: int, huge_page: int) -> str:
    return f"{count * huge_page / 2**20:.0f} MiB in {count} page{'s' * (count > 1)}"


def _refusals(failed: list[tuple[int, int]], huge_page: int, mappings: list) -> str:
    """What the kernel refused, by error, and the mapping of the first refused page (its
    span, name and VmFlags, from /proc/self/smaps: where to look for why)."""
    by_code: dict[int, int] = {}
    for _, code in failed:
        by_code[code] = by_code.get(code, 0) + 1
    text = "not moved: " + ", ".join(
        f"{_pages(count, huge_page)} ({errno.errorcode.get(code, code)}: {os.strerror(code)})"
        for code, count in by_code.items()
    )
    page = failed[0][0]
    mapping = next((m for m in mappings if m[0] <= page < m[1]), None)
    return text + f"; the first at {page:#x}" + (f", in {mapping[2]}" if mapping else "")


def _across(page: int, huge_page: int, mappings: list) -> bool:
    """Whether [page, page + huge_page) is not inside one of `mappings` (False when they
    could not be read: then nothing is known to lie across)."""
    return bool(mappings) and not any(
        start <= page and page + huge_page <= end for start, end, _ in mappings
    )


def _mappings() -> list[tuple[int, int, str]]:
    """The process's mappings as (start, end, "span name, flags VmFlags") from
    /proc/self/smaps (VmFlags `nh`: no huge pages asked); empty when it cannot be read."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    mappings = []
    for line in lines:
        header = re.match(r"([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+ *(.*)", line)
        if header:
            name = f"{header[1]}-{header[2]} {header[3] or '(anonymous)'}"
            mappings.append((int(header[1], 16), int(header[2], 16), name))
        elif mappings and line.startswith("VmFlags:"):
            start, end, name = mappings[-1]
            mappings[-1] = (start, end, f"{name}, flags {line.split(':', 1)[1].strip()}")
    return mappings


def page_range(pointer: int, size: int, huge_page: int | None = None) -> tuple[int, int]:
    """(start, length) of the whole huge pages inside [pointer, pointer + size); length 0
    when none fits."""
    huge_page = huge_page or huge_page_size()
    start = -(-pointer // huge_page) * huge_page
    end = (pointer + size) // huge_page * huge_page
    return (start, end - start) if end > start else (start, 0)


@functools.cache
def huge_page_size() -> int:
    try:
        with open(os.path.join(THP_DIR, "hpage_pmd_size")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return DEFAULT_HUGE_PAGE


def _whole_pages(tree) -> list[tuple[int, int]]:
    """(start, length) of the whole huge pages inside each CPU buffer of `tree` that has any."""
    ranges = [page_range(pointer, size) for pointer, size in _cpu_buffers(tree)]
    return [(start, length) for start, length in ranges if length]


def _cpu_buffers(tree) -> list[tuple[int, int]]:
    """(address, bytes) of every shard of `tree`'s arrays that lives on a CPU device, each
    written in full (device_put copies on XLA's threads, and a buffer still being written
    is refused). An array the engine deletes meanwhile (donated LoRA slots) is left out."""
    buffers = []
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        try:
            leaf.block_until_ready()
            for shard in leaf.addressable_shards:
                if shard.device.platform == "cpu" and shard.data.nbytes:
                    buffers.append((shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
        except RuntimeError:  # deleted (donated) since the tree was taken
            continue
    return buffers


def _unavailable() -> str | None:
    """Why huge pages cannot be asked for here, or None."""
    if os.environ.get(SWITCH, "1") == "0":
        return f"off ({SWITCH}=0)"
    if not sys.platform.startswith("linux"):
        return f"not on {sys.platform} (Linux only)"
    try:
        with open(os.path.join(THP_DIR, "enabled")) as f:
            setting = f.read()
    except OSError:
        return "the kernel has no transparent huge pages"
    if "[never]" in setting:
        return f"transparent huge pages are off ({THP_DIR}/enabled: never)"
    return None


@functools.cache
def _madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
