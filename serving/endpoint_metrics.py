"""The MLflow server's Prometheus metrics (`GET /metrics`) and how one request was answered (`Outcome`)."""

from __future__ import annotations

from dataclasses import dataclass

#: Error kinds by status, for `/metrics`: 4xx are the caller's, 5xx the server's (`side` label), but for
#: `CLIENT_5XX`.
ERROR_KINDS = {400: "invalid_input", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
               413: "too_large", 414: "uri_too_long", 415: "unsupported_media_type", 431: "headers_too_large",
               417: "expectation_failed", 500: "server_error", 503: "overloaded", 504: "timeout",
               505: "http_version_not_supported"}
#: 5xx answers a client chose: a 505 refuses the HTTP version its request line named, so a client that sends
#: `HTTP/2.0` lines raises no server-side error rate.
CLIENT_5XX = frozenset({505})
#: The kind of a 503 while the model is still busy with a call that timed out, and of a failed `/ready`.
MODEL_BUSY = "model_busy"
NOT_READY = "not_ready"
#: The kind of a 500 when the model (the pyfunc) failed on a request the contract had accepted.
MODEL_ERROR = "model_error"
#: The kind of a request whose client hung up before its body was in (nginx's 499): its 400 is never delivered.
CLIENT_CLOSED = "client_closed"
#: Methods that are label values; any other is counted as `other`.
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS")


def side(status: int) -> str:
    """Whose fault an error answer is, for the `side` label: `server` for a 5xx (but `CLIENT_5XX`), else `client`."""
    return "server" if status >= 500 and status not in CLIENT_5XX else "client"


@dataclass(frozen=True)
class Outcome:
    """How one request was answered: the status, the error kind where the status alone does not say it, and how
    many texts were scored."""

    status: int
    kind: str | None = None
    texts: int = 0


class Metrics:
    """Prometheus metrics of the endpoint, in a registry of their own (`/metrics`). prometheus_client's metrics
    take their own locks, so they may be updated from any thread."""

    def __init__(self, version: str, variant: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("sentiment_requests", "Requests answered, by path, method and status",
                                ["path", "method", "status"], registry=self.registry)
        self.latency = Histogram("sentiment_request_latency_seconds", "Time to answer a request, by path",
                                 ["path"], registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
        self.errors = Counter("sentiment_request_errors", "Requests answered with an error, by kind and by whose "
                              "fault it is (client: 4xx, server: 5xx)", ["kind", "side"], registry=self.registry)
        self.in_flight = Gauge("sentiment_requests_in_flight", "Scoring requests being answered now",
                               registry=self.registry)
        self.texts = Counter("sentiment_texts_scored", "Texts scored (valid requests answered 200)",
                             registry=self.registry)
        Gauge("sentiment_model_info", "The served model (always 1)", ["version", "variant"],
              registry=self.registry).labels(version, variant).set(1)

    def observe(self, path: str, method: str, outcome: Outcome, seconds: float) -> None:
        """One request the app answered; `path` is one of the server's routes or `other` (an unknown path never
        becomes a label value)."""
        method = method if method in METHODS else "other"
        status = outcome.status
        self.requests.labels(path, method, str(status)).inc()
        self.latency.labels(path).observe(seconds)
        if status >= 400:
            kind = outcome.kind or ERROR_KINDS.get(status, "server_error" if status >= 500 else "other")
            self.errors.labels(kind, side(status)).inc()
        elif outcome.texts:
            self.texts.inc(outcome.texts)

    def refused(self, status: int, kind: str) -> None:
        """An answer the connection's protocol gave itself (`request_deadline_protocol`: a 408 for headers too slow, a
        400 for bytes that are no request or for a body in too many small pieces, a 503 past the connection limit):
        counted under path and method `other`, with no latency; a request the app had begun to read is then not
        counted by the app (`PROTOCOL_REFUSED`)."""
        self.requests.labels("other", "other", str(status)).inc()
        self.errors.labels(kind, side(status)).inc()

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
