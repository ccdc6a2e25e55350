"""The router core's refusals: exceptions carrying the HTTP status a caller answers with."""


class RoutingError(Exception):
    """Base of the router's refusals; `status` is the HTTP status to answer with."""

    status = 500

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NoEligibleWorker(RoutingError):
    """No worker can take the request (503); `reason` says why, for the error body."""

    status = 503


class InvalidPin(RoutingError):
    """A request pins a worker that cannot serve the phase it is pinned for (400): the request,
    not the fleet, must change."""

    status = 400


class ContextTooLong(RoutingError):
    """The request needs more tokens of context than any eligible worker has (400, as vLLM
    answers such a request): the prompt or max_tokens must shrink."""

    status = 400


class Overloaded(RoutingError):
    """Every eligible worker is busy (503, as Dynamo answers); retry after `retry_after_s`
    seconds."""

    status = 503

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s
