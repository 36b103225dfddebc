"""Weights moved into 2 MiB pages, and the KV cache made in them (jengine/runner/huge_pages.py):
only whole pages inside a CPU buffer, values unchanged, reasons instead of errors, and the
kernel's own account (/proc/self/smaps) showing the pages moved where the kernel can move
them."""

import ctypes
import errno
import logging
import mmap
import platform
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jengine.runner import huge_pages
from jengine.runner.huge_pages import (
    HugePageReport,
    back_with_huge_pages,
    move_to_huge_pages,
    page_range,
    zeros_in_huge_pages,
)

MIB = 2**20


def huge_bytes_around(array: jax.Array) -> int:
    """AnonHugePages of the mappings that hold `array`'s buffer (the kernel's count)."""
    pointer = array.unsafe_buffer_pointer()
    end, total, overlaps = pointer + array.nbytes, 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                overlaps = int(span[1], 16) < end and int(span[2], 16) > pointer
            elif overlaps and line.startswith("AnonHugePages:"):
                total += int(line.split()[1]) * 1024
    return total


def mappings_over(array: jax.Array) -> list[tuple[bool, int]]:
    """(marked for huge pages: VmFlags "hg", AnonHugePages bytes) of each mapping over
    `array`'s whole 2 MiB pages. A mapping may hold other buffers beside it (anonymous
    mappings with the same flags merge; the cold suite saw 28 MiB of another buffer's huge
    pages counted so), so compare its huge pages before and after, not with a bound."""
    start, length = page_range(array.unsafe_buffer_pointer(), array.nbytes)
    found, over = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                over = int(span[1], 16) < start + length and int(span[2], 16) > start
                if over:
                    found.append([False, 0])
            elif over and line.startswith("AnonHugePages:"):
                found[-1][1] = int(line.split()[1]) * 1024
            elif over and line.startswith("VmFlags:"):
                found[-1][0] = "hg" in line.split()
    return [(marked, huge) for marked, huge in found]


def collapse_expected() -> bool:
    """Linux 6.1 or newer with transparent huge pages not set to never."""
    if not sys.platform.startswith("linux"):
        return False
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", platform.release()).groups())
    return (major, minor) >= (6, 1) and huge_pages._unavailable() is None


def test_page_range_keeps_to_whole_pages_inside_the_buffer():
    page = 2 * MIB
    assert page_range(0, 3 * page, page) == (0, 3 * page)
    assert page_range(64, 3 * page, page) == (page, 2 * page)  # the partial ends left alone
    assert page_range(page - 64, page + 128, page) == (page, page)
    assert page_range(64, page, page)[1] == 0  # no whole page inside
    assert page_range(page + 64, page - 128, page)[1] == 0


def test_weights_move_with_their_values(monkeypatch):
    monkeypatch.delenv(huge_pages.SWITCH, raising=False)
    rng = np.random.default_rng(0)
    host = rng.standard_normal((6, 1024, 1024), dtype=np.float32)  # 24 MiB
    weights = {"w": jnp.asarray(host), "small": jnp.ones((8,)), "count": 3}
    report = back_with_huge_pages(weights)
    start, length = page_range(weights["w"].unsafe_buffer_pointer(), weights["w"].nbytes)
    assert report.eligible_bytes == length >= 20 * MIB  # the 32-byte array has no whole page
    np.testing.assert_array_equal(np.asarray(weights["w"]), host)
    if collapse_expected():
        assert report.reason is None, report
        assert report.collapsed_bytes == report.eligible_bytes
        assert huge_bytes_around(weights["w"]) >= report.collapsed_bytes
        assert f"{length // MIB} MiB of weights in huge pages" in report.describe()
    else:  # an older kernel or THP off: said, not raised
        assert report.collapsed_bytes < report.eligible_bytes and report.reason
    # Already in huge pages: asked again, nothing changes and nothing fails.
    again = back_with_huge_pages(weights)
    assert again.collapsed_bytes == report.collapsed_bytes
    np.testing.assert_array_equal(np.asarray(weights["w"]), host)


def test_switched_off_touches_nothing(monkeypatch):
    monkeypatch.setenv(huge_pages.SWITCH, "0")
    weights = [jnp.zeros((3, 1024, 1024))]
    before = huge_bytes_around(weights[0])
    report = back_with_huge_pages(weights)
    assert report.collapsed_bytes == 0 and report.eligible_bytes > 0
    assert "JENGINE_HUGE_PAGES=0" in report.describe()
    assert huge_bytes_around(weights[0]) == before


def test_nothing_on_the_cpu_says_nothing():
    assert back_with_huge_pages({"tiny": jnp.ones((4, 4)), "host": np.ones(4)}) == HugePageReport()
    assert HugePageReport().describe() == ""


def test_a_donated_array_is_left_out_not_an_error(monkeypatch):
    monkeypatch.delenv(huge_pages.SWITCH, raising=False)
    kept, donated = jnp.ones((3, 1024, 1024)), jnp.ones((3, 1024, 1024))
    jax.jit(lambda x: x + 1, donate_argnums=0)(donated).block_until_ready()
    assert donated.is_deleted()
    report = back_with_huge_pages([kept, donated])
    assert report.eligible_bytes == page_range(kept.unsafe_buffer_pointer(), kept.nbytes)[1]


def pages_in_one_mapping(array: jax.Array) -> list[int]:
    """The array's whole huge pages that lie inside one of the process's mappings."""
    huge_page, mappings = huge_pages.huge_page_size(), huge_pages._mappings()
    start, length = page_range(array.unsafe_buffer_pointer(), array.nbytes)
    pages = range(start, start + length, huge_page)
    return [page for page in pages if not huge_pages._across(page, huge_page, mappings)]


def test_a_page_refused_for_a_moment_is_tried_again(monkeypatch):
    """The kernel refuses a page that is busy for a moment: a later pass moves it, and
    pages after a refused one are asked on their own. A page
    refused every time is named with its mapping; a kernel that always refuses gets its
    reason."""
    monkeypatch.delenv(huge_pages.SWITCH, raising=False)
    monkeypatch.setattr(huge_pages, "RETRY_PAUSE_S", 0.0)
    weights = [jnp.ones((3, 1024, 1024)), jnp.ones((3, 1024, 1024))]
    huge_page = huge_pages.huge_page_size()
    calls = []

    def answers(refused):  # the kernel's answers, not its work
        def madvise(start, length, advice):
            assert length == huge_page and start % huge_page == 0
            calls.append(start)
            if refused(start):
                ctypes.set_errno(errno.EINVAL)
                return -1
            return 0

        return madvise

    # The refused pages lie in one of the process's mappings: a page across two (where the
    # allocator put one) is never asked again (the next test), whatever the kernel says.
    busy = pages_in_one_mapping(weights[0])[0]

    def refused_once(start):
        return start == busy and calls.count(start) == 1

    monkeypatch.setattr(huge_pages, "_madvise", lambda: answers(refused_once))
    report = back_with_huge_pages(weights)
    assert report.reason is None and report.collapsed_bytes == report.eligible_bytes > 0
    num_pages = report.eligible_bytes // huge_page
    assert len(calls) == num_pages + 1 and calls[-1] == busy  # only the refused one again

    calls.clear()
    stuck = pages_in_one_mapping(weights[1])[-1]
    monkeypatch.setattr(huge_pages, "_madvise", lambda: answers(lambda start: start == stuck))
    report = back_with_huge_pages(weights)
    assert report.collapsed_bytes == report.eligible_bytes - huge_page
    assert calls.count(stuck) == huge_pages.TRIES
    reason = report.describe()
    assert "not moved: 2 MiB in 1 page (EINVAL" in reason and f"the first at {stuck:#x}" in reason
    if sys.platform.startswith("linux"):
        assert re.search(r"in [0-9a-f]+-[0-9a-f]+ .*, flags .*\bwr\b", reason), reason

    monkeypatch.setattr(huge_pages, "_madvise", lambda: answers(lambda _: True))
    report = back_with_huge_pages(weights)
    assert report.collapsed_bytes == 0 and report.eligible_bytes > 0
    assert "refused MADV_COLLAPSE" in report.describe()


def test_a_page_across_two_mappings_is_named_not_asked_again(monkeypatch):
    """A page whose 2 MiB run past its mapping's end cannot be one huge page (the cold
    suite saw one at the end of the [heap]): counted apart, asked once, said so."""
    monkeypatch.delenv(huge_pages.SWITCH, raising=False)
    monkeypatch.setattr(huge_pages, "RETRY_PAUSE_S", 0.0)
    weights = [jnp.ones((3, 1024, 1024))]
    huge_page = huge_pages.huge_page_size()
    start, length = page_range(weights[0].unsafe_buffer_pointer(), weights[0].nbytes)
    calls = []

    def madvise(page, size, advice):  # the kernel's answers: the first page is across
        calls.append(page)
        if page == start:
            ctypes.set_errno(errno.EINVAL)
            return -1
        return 0

    monkeypatch.setattr(huge_pages, "_madvise", lambda: madvise)
    # The first page's mapping ends 4 KiB into it; the next mapping holds the rest.
    mappings = [(0, start + 4096, "heap"), (start + 4096, start + length + huge_page, "next")]
    monkeypatch.setattr(huge_pages, "_mappings", lambda: mappings)
    report = back_with_huge_pages(weights)
    assert report.split_bytes == huge_page and calls.count(start) == 1
    assert report.collapsed_bytes == length - huge_page
    assert report.reason == "2 MiB in 1 page lie across two mappings (a huge page must lie in one)"


def test_the_kernel_refuses_a_page_across_two_real_mappings():
    """What the test above fakes, with the kernel: an anonymous mapping split in two (half
    of it made read-only) refuses the page across the split, and `_mappings` sees the
    split."""
    huge_page = huge_pages.huge_page_size()
    region = mmap.mmap(-1, 3 * huge_page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.write(b"\1" * len(region))  # every small page present
    anchor = ctypes.c_char.from_buffer(region)
    try:
        start, _ = page_range(ctypes.addressof(anchor), len(region), huge_page)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        assert libc.mprotect(start + huge_page // 2, huge_page // 2, mmap.PROT_READ) == 0
        mappings = huge_pages._mappings()
        assert huge_pages._across(start, huge_page, mappings)
        assert not huge_pages._across(start, huge_page // 2, mappings)
        assert not huge_pages._across(start + huge_page, huge_page, mappings)
        if collapse_expected():
            collapse = huge_pages._madvise()
            assert collapse(start, huge_page, huge_pages.MADV_COLLAPSE) == -1
            assert ctypes.get_errno() == errno.EINVAL
            assert collapse(start + huge_page, huge_page, huge_pages.MADV_COLLAPSE) == 0
    finally:
        del anchor
        region.close()


def test_in_the_background_the_report_is_logged(monkeypatch, caplog):
    monkeypatch.delenv(huge_pages.SWITCH, raising=False)
    weights = {"w": jnp.ones((4, 1024, 1024))}
    with caplog.at_level(logging.INFO, logger="jengine.runner.huge_pages"):
        report = move_to_huge_pages(weights).result(timeout=60)
    assert report.eligible_bytes > 0
    assert report.describe() in caplog.text


def test_a_cache_of_zeros_is_faulted_in_huge_pages_where_written(monkeypatch, caplog):
    """What `ModelRunner` does with the KV cache: zeros just made, advised before any step.
    A step's in-place write (the cache donated) keeps the buffer where it was and lands in
    huge pages; what no step wrote still reads zero, and memory never written holds none."""
    monkeypatch.delenv(huge_pages.SWITCH, raising=False)
    cache = jax.jit(lambda: jnp.zeros((4, 2, 1024, 1024)))()  # 32 MiB
    pointer = cache.unsafe_buffer_pointer()
    with caplog.at_level(logging.INFO, logger="jengine.runner.huge_pages"):
        report = zeros_in_huge_pages(cache)
    start, length = page_range(pointer, cache.nbytes)
    assert report.eligible_bytes == length >= 28 * MIB
    before = sum(huge for _, huge in mappings_over(cache))
    write = jax.jit(lambda c: c.at[1, 0, 256:264].set(1.0), donate_argnums=0)  # 32 KiB
    cache = write(cache)
    assert cache.unsafe_buffer_pointer() == pointer
    if collapse_expected():
        assert report.reason is None and report.collapsed_bytes == report.eligible_bytes
        assert f"{length // MIB} MiB of the KV cache in huge pages" in caplog.text
        mappings = mappings_over(cache)
        assert all(marked for marked, _ in mappings), mappings
        # The written 32 KiB sit in one 2 MiB page (or two); the rest was given back.
        assert 2 * MIB <= sum(huge for _, huge in mappings) - before <= 4 * MIB
    else:
        assert report.collapsed_bytes == 0 and report.reason
    values = np.asarray(cache)
    assert values.sum() == 8 * 1024 and (values[1, 0, 256:264] == 1).all()


def test_a_cache_switched_off_stays_in_small_pages(monkeypatch):
    monkeypatch.setenv(huge_pages.SWITCH, "0")
    cache = jax.jit(lambda: jnp.zeros((4, 2, 1024, 1024)))()
    before = huge_bytes_around(cache)  # 0 but where THP is "always"
    report = zeros_in_huge_pages(cache)
    assert report.collapsed_bytes == 0 and "JENGINE_HUGE_PAGES=0" in report.describe()
    cache = jax.jit(lambda c: c.at[1, 0, 256:264].set(1.0), donate_argnums=0)(cache)
    assert huge_bytes_around(cache) == before
