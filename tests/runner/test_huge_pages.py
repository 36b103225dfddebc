"""Weights on CPU move into transparent huge pages where Linux allows it, and never change.

Whether the kernel allows it is read from the machine (Linux 6.1+ for MADV_COLLAPSE, THP
not "never"): where it does, the weights' memory must show up as huge pages in
/proc/self/smaps; where it does not, nothing is collapsed and nothing fails.
"""

import os
import platform
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine import LLM
from jengine.runner.huge_pages import HUGE_PAGE_BYTES, back_with_huge_pages, huge_page_span
from tests.models.checkpoints import make_checkpoint

MIB = 1 << 20


def _kernel_collapses() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            enabled = f.read()
    except OSError:
        return False
    release = re.match(r"(\d+)\.(\d+)", platform.release())
    new_enough = release is not None and tuple(map(int, release.groups())) >= (6, 1)
    return new_enough and "[never]" not in enabled


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    mapping = None
    with open("/proc/self/smaps") as f:
        for line in f:
            span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                low, high = (int(v, 16) for v in span.groups())
                mapping = low <= address < high
            elif mapping and line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize(
    "pointer, num_bytes, span",
    [
        (0, 4 * MIB, (0, 4 * MIB)),
        (4096, 4 * MIB, (2 * MIB, 4 * MIB)),  # only whole huge pages inside the buffer
        (4096, 2 * MIB, None),
        (2 * MIB - 64, 3 * MIB, (2 * MIB, 4 * MIB)),
        (0, MIB, None),
    ],
)
def test_only_whole_huge_pages_inside_a_buffer_are_advised(pointer, num_bytes, span):
    assert huge_page_span(pointer, num_bytes) == span


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")
def test_weights_collapse_into_huge_pages_unchanged():
    weights = jax.random.normal(jax.random.key(0), (3, 1024, 1024), jnp.float32)  # 12 MiB
    before = np.asarray(weights).copy()
    collapsed = back_with_huge_pages({"w": weights, "scalar": jnp.float32(1)})
    np.testing.assert_array_equal(np.asarray(weights), before)
    if not _kernel_collapses():
        assert collapsed == 0
        return
    assert collapsed >= 10 * MIB
    address = -(-weights.unsafe_buffer_pointer() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    assert _huge_bytes_at(address) >= HUGE_PAGE_BYTES


@pytest.mark.skipif(not _kernel_collapses(), reason="this kernel keeps 4 KiB pages")
def test_the_engine_and_update_weights_put_weights_in_huge_pages(tmp_path):
    overrides = dict(hidden_size=256, intermediate_size=2048)  # [3, 2048, 256]: 6 MiB
    make_checkpoint("llama3", str(tmp_path), config_overrides=overrides)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, max_num_seqs=2)
    runner = llm.engine_core.runner
    largest = max(jax.tree.leaves(runner.params), key=lambda a: a.nbytes)
    assert largest.nbytes >= 4 * MIB, "the test model needs a weight of whole huge pages"

    def in_huge_pages(array) -> bool:
        address = -(-array.unsafe_buffer_pointer() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        return _huge_bytes_at(address) > 0

    assert in_huge_pages(largest)
    new = jax.tree.map(lambda a: np.asarray(a) * 0.5, runner.params)
    llm.update_weights(new)
    largest = max(jax.tree.leaves(runner.params), key=lambda a: a.nbytes)
    assert in_huge_pages(largest)
