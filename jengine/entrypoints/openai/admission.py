"""Admission: whether the server takes a generation request now, or answers 429 or 503.

Where it sits: on `app.state.admission`; routes.py asks it for a `Ticket` after a request
passed its checks and before the request reaches the engine, and gives the ticket back
when the response is over (a full body sent, or a stream ended or cut off). The graceful
shutdown (shutdown.py) turns `draining` on, and `closed` once --shutdown-timeout is over;
middleware.py counts the requests in flight.

Promises:
- with `--max-queued-requests N`, the engine's seats (max_num_seqs per replica) plus N
  sequences are all that is ever admitted; a request that would go beyond gets a 429 with
  `Retry-After`, before anything is sent to the engine. A request counts its sequences
  (n per prompt). The count is the server's own, taken when the request is admitted, so
  a burst cannot slip past it between two engine steps. A request of more sequences than
  seats and queue together is a 400, not a 429 that a client would retry forever;
- draining refuses only what arrives after the signal (middleware.py, at arrival): a
  request received before it is served, even if it reaches `admit` later (its body still
  being parsed or tokenized); once `closed` (the shutdown timeout is over), `admit` answers
  503 too.
"""

from dataclasses import dataclass

from jengine.entrypoints.openai.protocol import OpenAIError

RETRY_AFTER_SECONDS = 1


@dataclass
class Ticket:
    """One admitted request's sequences; `release` is idempotent (a stream may end in its
    own `finally` and in the response's background task)."""

    admission: "Admission"
    num_sequences: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.num_admitted -= self.num_sequences


class Admission:
    def __init__(self, num_seats: int, max_queued_requests: int | None = None):
        self.num_seats = num_seats
        self.max_queued_requests = max_queued_requests
        self.num_admitted = 0  # sequences of requests admitted and not yet over
        self.num_in_flight = 0  # HTTP requests received and not yet answered (middleware.py)
        self.draining = False  # new arrivals get 503
        self.closed = False  # past --shutdown-timeout: nothing more reaches the engine

    def admit(self, num_sequences: int, param: str | None = None) -> Ticket:
        """A ticket for a request of `num_sequences`, or an OpenAIError: 429 or 503, or a
        400 naming `param` for a request larger than all the room there is (retrying it
        could never help)."""
        if self.closed:
            raise shutting_down_error(TIMED_OUT)
        limit = self.max_queued_requests
        if limit is not None and num_sequences > self.num_seats + limit:
            raise OpenAIError(
                f"this request is {num_sequences} sequences (n for each prompt); the server "
                f"admits at most {self.num_seats + limit} at once ({self.num_seats} running "
                f"and --max-queued-requests {limit} queued)",
                param=param,
            )
        if limit is not None and self.num_admitted + num_sequences > self.num_seats + limit:
            raise OpenAIError(
                f"The server is busy: {self.num_admitted} sequences are running or queued "
                f"(room for {self.num_seats} running and {limit} queued). Retry later.",
                429,
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        self.num_admitted += num_sequences
        return Ticket(self, num_sequences)


TIMED_OUT = "; the request did not finish within --shutdown-timeout"


def shutting_down_error(detail: str = "") -> OpenAIError:
    return OpenAIError(f"The server is shutting down{detail}", 503)
