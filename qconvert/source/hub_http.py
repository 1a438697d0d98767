"""Every request qconvert makes through huggingface_hub, bounded: a server that stops answering is one error.

huggingface_hub's own client has no timeout by default and retries a timed-out request five times with growing
waits (a Hub that accepted connections and never answered held a conversion for minutes). `bound_hub_requests()`
installs, once, a client whose transport gives every request CONNECT_TIMEOUT_S to connect and READ_TIMEOUT_S
between bytes, and turns a timeout (on the request or while its body streams) into HubNotAnswering: an error
huggingface_hub does not retry, which names the endpoint, the request, and what was slow. Status answers (429,
5xx) keep huggingface_hub's bounded backoff: at most 5 retries.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

# Seconds to open a connection, and seconds a request may go without a byte (sent or received).
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 10.0

_installed = threading.Lock()
_done = False
# The wait between bytes of requests made in this context: READ_TIMEOUT_S, or what `patient` allows.
_read_limit: contextvars.ContextVar[float] = contextvars.ContextVar("hub_read_limit", default=READ_TIMEOUT_S)


@contextlib.contextmanager
def patient(read_timeout_s: float) -> Iterator[None]:
    """Requests made inside the block (in this thread) may wait `read_timeout_s` between bytes: for calls whose
    answer the Hub computes for a while (a commit of many files)."""
    token = _read_limit.set(read_timeout_s)
    try:
        yield
    finally:
        _read_limit.reset(token)


class HubNotAnswering(TimeoutError):
    """A Hub request that timed out; not one of the httpx errors huggingface_hub retries."""

    def __init__(self, method: str, url: str, what: str):
        parts = urlsplit(url)
        self.endpoint = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
        self.request = f"{method} {parts.path}"
        self.what = what
        super().__init__(f"{self.endpoint} {what} ({self.request})")


def _bounded(timeout: dict | None) -> dict:
    """A request's timeouts, none longer than the bounds (huggingface_hub passes some of its own, or None)."""
    timeout = dict(timeout or {})
    read = _read_limit.get()
    limits = {"connect": CONNECT_TIMEOUT_S, "read": read, "write": read, "pool": CONNECT_TIMEOUT_S}
    return {key: min(limit, timeout.get(key) or limit) for key, limit in limits.items()}


def _what_timed_out(err: Exception, connect_limit: float, read_limit: float) -> str:
    import httpx2

    if isinstance(err, (httpx2.ConnectTimeout, httpx2.PoolTimeout)):
        return f"did not accept a connection within {connect_limit:g} s"
    if isinstance(err, httpx2.WriteTimeout):
        return f"took nothing of the request for {read_limit:g} s"
    return f"accepted the request but sent nothing for {read_limit:g} s"


def _not_answering(request, limits: dict, err: Exception) -> HubNotAnswering:
    """The error a timed-out request (or its body) ends with, naming what was slow."""
    return HubNotAnswering(request.method, str(request.url), _what_timed_out(err, limits["connect"], limits["read"]))


def _bounded_stream_type():
    """The response body wrapper (a class built on call: httpx2 is imported only when the Hub is asked)."""
    import httpx2

    class BoundedStream(httpx2.SyncByteStream):
        """A response body whose read timeouts end the request instead of starting huggingface_hub's retries."""

        def __init__(self, stream, request, limits):
            self._stream, self._request, self._limits = stream, request, limits

        def __iter__(self):
            try:
                yield from self._stream
            except httpx2.TimeoutException as err:
                raise _not_answering(self._request, self._limits, err) from None

        def close(self):
            self._stream.close()

    return BoundedStream


def _bounded_transport_type():
    """The transport wrapper that bounds every request's timeouts and wraps its response body."""
    import httpx2

    bounded_stream = _bounded_stream_type()

    class BoundedTransport(httpx2.BaseTransport):
        """The client's own transport (direct, or the proxy its environment names), its timeouts bounded."""

        def __init__(self, inner):
            self._inner = inner

        def handle_request(self, request):
            limits = _bounded(request.extensions.get("timeout"))
            request.extensions["timeout"] = limits
            try:
                response = self._inner.handle_request(request)
            except httpx2.TimeoutException as err:
                raise _not_answering(request, limits, err) from None
            response.stream = bounded_stream(response.stream, request, limits)
            return response

        def close(self):
            self._inner.close()

    return BoundedTransport


def _client():
    import httpx2
    from huggingface_hub.utils._http import hf_request_event_hook

    bounded_transport = _bounded_transport_type()
    client = httpx2.Client(event_hooks={"request": [hf_request_event_hook]}, follow_redirects=True,
                           timeout=httpx2.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
    # The transports the client chose (HTTPS_PROXY, NO_PROXY and the rest, read as httpx reads them), wrapped.
    client._transport = bounded_transport(client._transport)
    client._mounts = {pattern: bounded_transport(inner) if inner is not None else None
                      for pattern, inner in client._mounts.items()}
    return client


def bound_hub_requests() -> None:
    """Make huggingface_hub's shared client the bounded one (idempotent; before the first Hub call)."""
    global _done
    with _installed:
        if _done:
            return
        from huggingface_hub import set_client_factory

        set_client_factory(_client)
        _done = True
