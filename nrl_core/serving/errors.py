"""The request errors the endpoint answers with HTTP 400, below both the routes and the server."""


class RequestError(ValueError):
    """Bad request content (HTTP 400)."""


class SamplingError(ValueError):
    """A request asking for sampling settings the server will not use (HTTP 400)."""
