"""Reading a request's headers under the endpoint's contract (`pipeline.deployment.protocol`): its media type (what
kind of body it declares, and whether this endpoint takes it) and its content coding (none, or `identity`)."""

from __future__ import annotations

import collections
import re

from pipeline.deployment.protocol import JSON_MEDIA_TYPES, TEXT_COLUMN, RequestError

#: Media types a 415 names (others are "this Content-Type"): what clients commonly send by mistake.
NAMED_MEDIA_TYPES = frozenset({
    "application/xml", "text/xml", "text/html", "application/octet-stream", "application/x-ndjson",
    "application/jsonl", "application/msgpack", "application/x-msgpack", "application/x-protobuf",
    "application/yaml", "text/yaml", "application/x-yaml", "text/tab-separated-values", "text/plain", "text/csv",
    "application/gzip", "application/zip", "application/parquet", "application/vnd.apache.parquet",
})
#: Content codings a 415 names (others are "this Content-Encoding"): the registered ones clients send.
NAMED_CODINGS = frozenset({"gzip", "x-gzip", "deflate", "br", "zstd", "compress", "x-compress"})


#: Optional whitespace around header list elements and parameters: space and tab only (RFC 9110 5.6.3). Not
#: `str.strip()`'s Unicode whitespace: `application/json\xa0` is no media type, and would otherwise read as JSON.
OWS = " \t"
#: What TorchServe's HTTP layer (Netty) trims off both ends of a header value before its handler sees it: Java's
#: `Character.isWhitespace` over one byte, i.e. space, tab, LF, VT, FF, CR and the separators 0x1C-0x1F (not NBSP
#: or NEL). Trimmed here too, so the MLflow server (h11 trims only space and tab) answers the same value alike.
HEADER_VALUE_TRIM = " \t\n\x0b\x0c\r\x1c\x1d\x1e\x1f"
#: `type/subtype+json` in tokens (RFC 9110 5.6.2's tchar, lower-cased), the subtype's name before `+json` not empty.
_JSON_SUFFIX_TYPE = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+/[!#$%&'*+\-.^_`|~0-9a-z]+\+json")


def media_type(content_type: str | None) -> tuple[str, dict[str, str]]:
    """`(type, parameters)` of a Content-Type header, lower-cased; `("", {})` when absent or blank, and `("", ...)`
    when only parameters were sent."""
    media, params = _split(content_type)
    return media, dict(params)


def _split(content_type: str | None) -> tuple[str, list[tuple[str, str]]]:
    """A Content-Type's media type and its parameters in the order sent, a repeated one as often as it was sent."""
    content_type = (content_type or "").strip(HEADER_VALUE_TRIM)
    if not content_type:
        return "", []
    media, *params = content_type.split(";")
    parsed = []
    for param in params:
        key, _, value = param.partition("=")
        if key.strip(OWS):  # an empty parameter (`application/json;`) is allowed by RFC 9110 and means nothing
            parsed.append((key.strip(OWS).lower(), value.strip(OWS).strip('"').lower()))
    return media.strip(OWS).lower(), parsed


def is_json_media_type(content_type: str | None) -> bool:
    """`application/json` or a `type/name+json` suffix type (RFC 6839), parameters (charset) ignored; a bare
    `+json`, `application/+json` or a type without its `/` is not one."""
    return _is_json(media_type(content_type)[0])


def _is_json(media: str) -> bool:
    """A parsed media type (`media_type`'s first part) is JSON: not parsed again, so what surrounds the type inside
    the header stays part of it."""
    return media in JSON_MEDIA_TYPES or _JSON_SUFFIX_TYPE.fullmatch(media) is not None


def body_kind(content_type: str | None, shapes: frozenset[str]) -> str:
    """`json`, `plain` or `csv` for a declared Content-Type this endpoint takes; else `RequestError(415)`."""
    media, sent = _split(content_type)
    params = dict(sent)
    accepted = ["application/json"] + (["text/plain"] if "plain" in shapes else []) + \
        (["text/csv"] if "csv" in shapes else [])
    if not media:
        said = "no Content-Type header" if not params and not (content_type or "").strip(HEADER_VALUE_TRIM) else \
            "a Content-Type with no media type"
        raise RequestError(415, f"{said}; send one of {', '.join(accepted)}")
    if media == "application/x-www-form-urlencoded" or media.startswith("multipart/"):
        form = media if media in ("application/x-www-form-urlencoded", "multipart/form-data") else "multipart"
        raise RequestError(415, f"a form-encoded body ({form}) is not accepted: send the JSON itself with "
                                "'Content-Type: application/json' (curl -d sends form encoding unless told -H)")
    if len(params) < len(sent):  # a proxy may read the first, this endpoint would read the last: read two ways
        counts = collections.Counter(key for key, _ in sent)  # linear: the header may hold thousands of them
        # named only when it is one this endpoint reads: a parameter's name is the client's text too
        twice = sorted(key for key, n in counts.items() if n > 1 and key in ("charset", "header"))
        named = f" ({', '.join(twice)})" if twice else ""
        raise RequestError(415, f"a Content-Type parameter given more than once{named}: send it once")
    charset = params.get("charset", "utf-8")
    if charset not in ("utf-8", "utf8"):
        raise RequestError(415, "only charset=utf-8 is accepted")
    allowed = {"charset", "header"} if media == "text/csv" else {"charset"}  # text/csv's header: RFC 4180
    if set(params) - allowed:
        raise RequestError(415, f"Content-Type parameters other than {' and '.join(sorted(allowed))} are not "
                                "accepted")
    if params.get("header", "present") != "present" and "csv" in shapes:  # its value is not quoted back
        raise RequestError(415, f"text/csv with a header parameter other than header=present is not accepted: "
                                f"the body needs a header row, \"{TEXT_COLUMN}\"")
    if _is_json(media):
        return "json"
    if media == "text/plain" and "plain" in shapes:
        return "plain"
    if media == "text/csv" and "csv" in shapes:
        return "csv"
    # named only when it is a well-known type: the header is the client's text, and no error quotes the input
    shown = f"Content-Type {media}" if media in NAMED_MEDIA_TYPES else "this Content-Type"
    raise RequestError(415, f"{shown} is not accepted; send one of {', '.join(accepted)}")


def check_content_encoding(content_encoding: str | None) -> None:
    """`RequestError(415)` unless the body is sent as it is (no Content-Encoding, or `identity`): neither server
    decompresses, and a compressed body read as text would be refused for the wrong reason (not UTF-8), or a plain
    one labelled compressed scored as though the label were not there (RFC 9110 8.4.1: 415 for a coding the server
    does not take)."""
    value = (content_encoding or "").strip(HEADER_VALUE_TRIM)
    codings = [c.strip(OWS).lower() for c in value.split(",") if c.strip(OWS)]
    if any(c != "identity" for c in codings):
        shown = " and ".join(sorted({c for c in codings if c in NAMED_CODINGS})) or "this Content-Encoding"
        raise RequestError(415, f"a compressed body ({shown}) is not accepted: send it uncompressed, without a "
                                "Content-Encoding header")


def encoding_refused(headers: dict[str, str]) -> RequestError | None:
    """The 415 of a Content-Encoding the server cannot read (`check_content_encoding`), or None: for a server that
    answers it before reading the body."""
    try:
        check_content_encoding(headers.get("content-encoding"))
    except RequestError as err:
        return err
    return None
