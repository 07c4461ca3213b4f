"""The request errors the endpoint answers with (HTTP 4xx, or 500 for a failed generation),
below both the routes and the server."""


class RequestError(ValueError):
    """Bad request content (HTTP 400, or ``status``: 413 too large, 408 too slow)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class GenerationFailed(RuntimeError):
    """The backend raised while generating a request (HTTP 500 naming the error)."""

    status = 500


class SamplingError(ValueError):
    """A request asking for sampling settings the server will not use (HTTP 400)."""
