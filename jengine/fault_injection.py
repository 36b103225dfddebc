"""Faults on purpose, for the hardening tests: raise at a named site, for marked requests.

Where it sits: the few places where a fault must end only the requests it touches (the
front end building one request's output, the HTTP layer formatting it) or must take the
engine down cleanly (inside an engine step) ask their `FaultInjector` before doing the
work. Tests set it through the environment of the processes they start, so the hook
reaches the engine-core process too.

Off in production: unless `JENGINE_FAULT_INJECTION` is set, `FaultInjector.from_env()`
is None and each site costs one `is None` check. The variable holds `site=marker` pairs,
comma-separated; the site raises `InjectedFault` for every request whose id contains the
marker (`output=boom` ends any request with "boom" in its id while its output is built).
"""

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV_VAR = "JENGINE_FAULT_INJECTION"
# engine_step: inside EngineCore.step, after scheduling (engine process);
# output: OutputProcessor, taking in one request's engine output (API process);
# format: the OpenAI layer, turning one request's output into a response or a chunk.
SITES = ("engine_step", "output", "format")


class InjectedFault(RuntimeError):
    """The exception a site raises on purpose."""


@dataclass(frozen=True)
class FaultInjector:
    markers: dict[str, str]  # site -> marker in the request ids it fails

    @classmethod
    def from_env(cls) -> "FaultInjector | None":
        spec = os.environ.get(ENV_VAR, "").strip()
        if not spec:
            return None
        markers = {}
        for pair in spec.split(","):
            site, _, marker = pair.partition("=")
            if site not in SITES or not marker:
                raise ValueError(f"{ENV_VAR}: {pair!r} is not SITE=MARKER with SITE in {SITES}")
            markers[site] = marker
        logger.warning("fault injection is on (%s=%s): for tests only", ENV_VAR, spec)
        return cls(markers)

    def check(self, site: str, request_ids: str | Iterable[str]) -> None:
        """Raise `InjectedFault` if `site` is armed and one of `request_ids` is marked."""
        marker = self.markers.get(site)
        if marker is None:
            return
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            if marker in request_id:
                raise InjectedFault(f"fault injected at {site} for request {request_id}")
