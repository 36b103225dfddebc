"""N-gram prompt lookup: draft tokens for speculative decoding from a request's own text.

Where it sits: with `--speculative-config '{"method": "ngram", ...}'` the Scheduler asks
its `NgramProposer` after every step, for each request that may speculate
(`step_results.draft_room`), what might come next:
if the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) occurred
earlier in the prompt + output, the tokens that followed their latest earlier occurrence
are the drafts. The target model verifies them in the next step (jengine/runner/
spec_decode.py); a draft costs nothing when rejected but a slot of the token budget.

Promises: numpy only (no jax), each request's search vectorised over its tokens (one
sliding-window comparison per n, no Python loop over positions); at most
`num_speculative_tokens` drafts, fewer near the end of the text.
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int):
        self.min_n = min_n
        self.max_n = max_n
        self.k = num_speculative_tokens

    def propose(self, token_ids: list[int], max_drafts: int | None = None) -> list[int]:
        """Drafts following the latest earlier occurrence of the longest matching suffix."""
        limit = self.k if max_drafts is None else min(self.k, max_drafts)
        num_tokens = len(token_ids)
        if limit <= 0 or num_tokens < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            # Windows starting before the suffix itself: an earlier occurrence.
            windows = sliding_window_view(tokens[: num_tokens - 1], n)
            hits = np.flatnonzero((windows == tokens[num_tokens - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # what followed the latest occurrence
                return tokens[start : start + limit].tolist()
        return []
