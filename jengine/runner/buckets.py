"""Padding buckets: the few fixed shapes every step is padded to. Pure functions.

Where it sits: `input_batch.py` picks a `StepShape` for each SchedulerOutput;
`model_runner.py` compiles every shape of `BucketSpec.all_shapes()` at warmup, so serving
compiles nothing.

A step's shape is (tokens T, requests R, pages per request P, query block Bq):
- decode-only steps (every request runs one token): T = R, a power of two up to
  `max_num_seqs`, and Bq = 1 (one gathered copy of the pages per request);
- steps with a prefill chunk: T a bucket of 16 * 2^k up to `max_num_batched_tokens`,
  R = min(T, max_num_seqs) rounded up to a power of two, Bq = PREFILL_Q_BLOCK;
- P: the longest context in the step, rounded up to MIN_PAGES * 4^k pages, capped at the
  pages of `max_model_len`. The attention walks only the chunks of pages some request
  needs and skips the rest at run time, so a wide block table costs a few skipped loop
  iterations, not compute: P grows by 4x per bucket to keep the shape count low.
Padding waste of T and R is below 2x; the number of shapes is
(#request buckets + #token buckets) x #page buckets, e.g. (7 + 6) x 2 = 26 for
max_num_seqs 64, max_num_batched_tokens 512, max_model_len 512 and block_size 16.

The LM head and the sampler run over a step's sampling rows only, padded to their own
request bucket S <= R (`sample_rows`): a lone 128-token prompt computes one row of logits,
not R = min(128, max_num_seqs). The forward programs stay per shape, head and sampler are
one program per S, and keeping S of R rows is a tiny program per (R, S) pair
(`all_row_selections`). With `sample_rows_fixed` (a draft model reads the step's sampled
rows, and its programs are per R), S = R always.
"""

from bisect import bisect_left
from dataclasses import dataclass
from functools import cached_property

from jengine.core.kv_cache_utils import cdiv

MIN_TOKENS = 16
MIN_PAGES = 8
PREFILL_Q_BLOCK = 16


@dataclass(frozen=True, order=True)
class StepShape:
    num_tokens: int  # T
    num_reqs: int  # R
    num_pages: int  # P
    q_block_size: int  # Bq

    @property
    def is_decode(self) -> bool:
        return self.q_block_size == 1


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def capped_buckets(start: int, cap: int, growth: int = 2) -> list[int]:
    """start, growth*start, growth^2*start, ... below cap, then cap itself."""
    buckets, size = [], start
    while size < cap:
        buckets.append(size)
        size *= growth
    return [*buckets, cap]


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    return capped_buckets(MIN_TOKENS, max_num_batched_tokens)


def request_buckets(max_num_seqs: int) -> list[int]:
    return capped_buckets(1, max_num_seqs)


def page_buckets(max_pages: int) -> list[int]:
    return capped_buckets(min(MIN_PAGES, max_pages), max_pages, growth=4)


def smallest_fitting(buckets: list[int], n: int) -> int:
    """The first bucket >= n (buckets ascending)."""
    i = bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def max_pages_per_request(max_model_len: int, block_size: int) -> int:
    return cdiv(max_model_len, block_size)


@dataclass(frozen=True)
class BucketSpec:
    """The bucket lists of one engine configuration."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_pages: int
    sample_rows_fixed: bool = False

    @classmethod
    def create(cls, max_num_seqs, max_num_batched_tokens, max_model_len, block_size, **options):
        return cls(
            max_num_seqs,
            max_num_batched_tokens,
            max_pages_per_request(max_model_len, block_size),
            **options,
        )

    # The bucket lists and shapes, built once: shape_for runs every step.
    @cached_property
    def _request_buckets(self) -> list[int]:
        return request_buckets(self.max_num_seqs)

    @cached_property
    def _token_buckets(self) -> list[int]:
        return token_buckets(self.max_num_batched_tokens)

    @cached_property
    def _page_buckets(self) -> list[int]:
        return page_buckets(self.max_pages)

    @cached_property
    def _shapes(self) -> dict[tuple[int, int, int, int], StepShape]:
        return {}

    def prefill_num_reqs(self, num_tokens: int) -> int:
        return smallest_fitting(self._request_buckets, min(num_tokens, self.max_num_seqs))

    def shape_for(self, num_tokens: int, num_reqs: int, max_pages_used: int) -> StepShape:
        """The padded shape of a step with these many tokens, requests and pages."""
        num_pages = smallest_fitting(self._page_buckets, max(1, max_pages_used))
        if num_tokens == num_reqs:  # decode-only: one token per request
            padded = smallest_fitting(self._request_buckets, num_reqs)
            key = (padded, padded, num_pages, 1)
        else:
            padded_tokens = smallest_fitting(self._token_buckets, num_tokens)
            # Every request has a token, so R <= min(T, max_num_seqs) always fits.
            padded_reqs = self.prefill_num_reqs(padded_tokens)
            key = (padded_tokens, padded_reqs, num_pages, PREFILL_Q_BLOCK)
        shape = self._shapes.get(key)
        if shape is None:  # at most len(all_shapes()) of them
            shape = self._shapes[key] = StepShape(*key)
        return shape

    def _rows_are_requests(self, shape: StepShape) -> bool:
        """Whether S = R in steps of `shape` (decode steps sample every request)."""
        return shape.is_decode or self.sample_rows_fixed

    def sample_rows(self, shape: StepShape, num_rows: int) -> int:
        """S: the padded number of sampling rows of a step of `shape` with `num_rows`."""
        if self._rows_are_requests(shape):
            return shape.num_reqs
        return smallest_fitting(self._request_buckets, num_rows)

    def all_row_selections(self) -> list[tuple[int, int]]:
        """Every (R, S) with S < R a step can keep S of its R rows with: what warmup
        compiles besides the shapes."""
        pairs = set()
        for shape in self.all_shapes():
            if not self._rows_are_requests(shape):
                R = shape.num_reqs
                pairs.update((R, rows) for rows in self._request_buckets if rows < R)
        return sorted(pairs)

    def all_shapes(self) -> list[StepShape]:
        """Every shape `shape_for` can return: what warmup compiles."""
        shapes = set()
        for num_pages in page_buckets(self.max_pages):
            for reqs in request_buckets(self.max_num_seqs):
                shapes.add(StepShape(reqs, reqs, num_pages, 1))
            for tokens in token_buckets(self.max_num_batched_tokens):
                reqs = self.prefill_num_reqs(tokens)
                shapes.add(StepShape(tokens, reqs, num_pages, PREFILL_Q_BLOCK))
        return sorted(shapes)
