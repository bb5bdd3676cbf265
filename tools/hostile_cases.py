"""Hostile HTTP requests as data, and the hypothesis strategies that draw them.

Why a module of its own: ``tests/test_fuzz_http.py`` (hypothesis draws the cases, a few
hundred) and ``python -m tools.lab fuzz`` (``sample_cases`` draws thousands from the same
strategy) must send the same cases; ``tools/hostile_client.py`` sends one and judges it.

A ``HostileCase`` is one request to a JSON route (``ROUTES``): a body of some ``kind``
(arbitrary bytes, arbitrary JSON, wrong types, huge numbers, deep nesting, NUL, invalid
UTF-8, over the size limit, or a small valid request so that real streams run among the
hostile ones, or one with a constraint: a schema, regex or grammar, ordinary, broken,
random or dear, ``constraints``), a content type (or none, or an odd one), and a ``Framing``:

* ``LENGTH``: ``Content-Length`` and the whole body;
* ``CHUNKED``: ``Transfer-Encoding: chunked`` in random chunk sizes (sometimes with a
  malformed size line);
* ``CONFLICT``: both ``Content-Length`` and ``Transfer-Encoding`` (the smuggling shape);
* ``SHORT``: ``Content-Length`` larger than what is sent, then FIN;
* ``SLOWLORIS``: the head sent byte by byte, slowly, then abandoned: FIN, or silence.

``HostileCase.wire`` is every byte a case sends; ``to_json`` is its reproducer.
"""

from __future__ import annotations

import base64
import enum
import json
from dataclasses import asdict, dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

ROUTES = ("/v1/stream", "/v1/generate", "/v1/completions", "/v1/chat/completions")
# Every field either route knows, so that wrong types reach the validators.
FIELDS = ("prompt", "max_new_tokens", "stop", "temperature", "top_p", "top_k", "seed",
          "ignore_eos", "policy", "model", "max_tokens", "stream", "n", "logprobs", "echo",
          "best_of", "suffix", "messages", "role", "content", "max_completion_tokens")
NUMERIC_FIELDS = ("max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "n")
# JSON number texts a parser may choke on: overflow, underflow, non-JSON literals.
HUGE_NUMBERS = ("1e999", "-1e999", "1E400", "1e-999", "NaN", "Infinity", "-Infinity", "-0",
                "1" + "0" * 400, "-" + "9" * 4000, str(2**63), str(2**64), str(-(2**63) - 1),
                "0." + "0" * 300 + "1", "1.5", "4.0", "1e2", "01", "+1", ".5", "0x10")
BAD_UTF8 = (b"\xff", b"\xfe\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
            b"\xe2\x82", b"\x80", b"\xf8\x88\x80\x80\x80")
JSON = "application/json"
# Odd content types: each is refused (415) or read as JSON; one case in ODD_TYPE_EVERY
# draws one, the rest send JSON, so that most bodies reach the validators and the valid
# ones run real streams (with every type equally likely, 38% of cases were 415s).
ODD_CONTENT_TYPES = (None, "text/plain", "", "application/x-www-form-urlencoded",
                     "multipart/form-data; boundary=zz", "application/json; charset=utf-16",
                     "application/json; charset=latin-1", "*/*", "application/ld+json",
                     "text/event-stream", "application/json\x00",
                     "application/json; charset=\x7f\x80", "APPLICATION/JSON",
                     "application/json; charset=utf-8")
ODD_TYPE_EVERY = 8
# Constraints (issue 43): ordinary ones, broken ones, the nested counts that cost 50-150 ms
# a mask under the library's default limits, and random regex and grammar text.
NESTED_COUNTS = ("((a{60}){60}){60}", "(((a{20}){20}){20}){20}", "(.{1,50}){1,50}z",
                 "((x{40}){40}){40}y", "(a|aa){1,60}b")
REGEX_TEXT = "ab.()[]{}|*+?^$\\0123456789,-"
constraints = st.one_of(
    st.just({"type": "json_object"}),
    st.sampled_from(NESTED_COUNTS).map(lambda p: {"type": "regex", "pattern": p}),
    st.sampled_from(NESTED_COUNTS).map(lambda p: {"type": "json_schema", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": p}}}}),
    st.text(REGEX_TEXT, max_size=24).map(lambda p: {"type": "regex", "pattern": p}),
    st.sampled_from(('start: "yes" | "no"', "start: a\na: a", "start: /[0-9]{1,3}/",
                     'start: ("x" start)?', "start: ((((")).map(
        lambda g: {"type": "grammar", "grammar": g}),
    st.sampled_from(({"type": "integer", "minimum": 0, "maximum": 9},
                     {"type": "object", "properties": {"n": {"type": "number"}}},
                     {"type": "string", "maxLength": 5}, {"type": "frob"},
                     {"type": "array", "items": {"type": "boolean"}, "maxItems": 2})).map(
        lambda schema: {"type": "json_schema", "schema": schema}),
)
content_types = st.integers(1, ODD_TYPE_EVERY).flatmap(
    lambda n: st.sampled_from(ODD_CONTENT_TYPES) if n == 1 else st.just(JSON))


class Framing(enum.Enum):
    LENGTH = "length"  # Content-Length, the whole body
    CHUNKED = "chunked"  # Transfer-Encoding: chunked
    CONFLICT = "conflict"  # both Content-Length and Transfer-Encoding
    SHORT = "short"  # Content-Length larger than the body sent, then FIN
    SLOWLORIS = "slowloris"  # the head byte by byte, then abandoned


# Sent without their end: the server may close instead of answering.
INCOMPLETE = (Framing.SHORT, Framing.SLOWLORIS)


@dataclass(frozen=True)
class HostileCase:
    kind: str  # what the body is: "bytes", "json", "wrong_types", "numbers", ...
    path: str
    body: bytes
    content_type: str | None
    framing: Framing
    connection_close: bool = False
    chunks: tuple[int, ...] = ()  # CHUNKED: chunk sizes (the rest goes in one more)
    bad_chunk: bool = False  # CHUNKED: a size line that is not hex
    missing: int = 0  # SHORT: bytes declared and never sent
    cut: int = 0  # SLOWLORIS: head bytes sent before abandoning
    pace_s: float = 0.0  # SLOWLORIS: pause between bytes
    fin: bool = True  # SLOWLORIS: abandoned with a FIN (else silence)

    def head(self, host: str) -> bytes:
        lines = [f"POST {self.path} HTTP/1.1".encode(), f"Host: {host}".encode()]
        if self.content_type is not None:
            lines.append(b"Content-Type: " + self.content_type.encode("latin-1"))
        if self.framing in (Framing.LENGTH, Framing.SLOWLORIS, Framing.CONFLICT):
            lines.append(f"Content-Length: {len(self.body)}".encode())
        if self.framing is Framing.SHORT:
            lines.append(f"Content-Length: {len(self.body) + self.missing}".encode())
        if self.framing in (Framing.CHUNKED, Framing.CONFLICT):
            lines.append(b"Transfer-Encoding: chunked")
        if self.connection_close:
            lines.append(b"Connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n"

    def wire(self, host: str) -> bytes:
        """Every byte this case sends, in order."""
        head = self.head(host)
        if self.framing is Framing.SLOWLORIS:
            return head[: self.cut]
        if self.framing in (Framing.CHUNKED, Framing.CONFLICT):
            return head + self._chunked()
        return head + self.body

    def _chunked(self) -> bytes:
        out, rest = [], self.body
        for size in self.chunks:
            if not rest:
                break
            piece, rest = rest[:size], rest[size:]
            out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        if rest:
            out.append(b"%x\r\n%s\r\n" % (len(rest), rest))
        if self.bad_chunk:
            out.insert(len(out) // 2, b"zz\r\nzz\r\n")
        return b"".join(out) + b"0\r\n\r\n"

    def to_json(self, host: str = "127.0.0.1") -> dict[str, Any]:
        """A reproducer: what it is, and its exact bytes (base64)."""
        data = asdict(self)
        data["framing"] = self.framing.value
        data["body"] = self.body[:200].decode("latin-1")
        data["wire_b64"] = base64.b64encode(self.wire(host)).decode()
        return data


# -- generators --------------------------------------------------------------------------------

_scalars = (st.none() | st.booleans() | st.integers()
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=24))
json_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=10)


def _dump(value: Any, ascii_only: bool = True) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode()


@st.composite
def bodies(draw: st.DrawFn, path: str, max_body_bytes: int) -> tuple[str, bytes]:
    """(kind, body) for ``path``; see the module docstring for the kinds."""
    kind = draw(st.sampled_from(("bytes", "json", "wrong_types", "wrong_types", "numbers",
                                 "nesting", "nul", "utf8", "oversize", "valid", "valid",
                                 "constraint")))
    prompt = draw(st.text(min_size=1, max_size=24))
    if kind == "bytes":
        return kind, draw(st.binary(max_size=300))
    if kind == "json":
        return kind, _dump(draw(json_values), draw(st.booleans()))
    if kind == "wrong_types":
        wrong = draw(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=5))
        return kind, _dump({"prompt": prompt, **wrong}, draw(st.booleans()))
    if kind == "numbers":
        name = draw(st.sampled_from(NUMERIC_FIELDS))
        number = draw(st.sampled_from(HUGE_NUMBERS)
                      | st.integers(-(2**256), 2**256).map(str))
        return kind, b'{"prompt": %s, "%s": %s}' % (_dump(prompt), name.encode(), number.encode())
    if kind == "nesting":
        depth = draw(st.integers(1, 3 * max_body_bytes))
        shape = draw(st.sampled_from(("array", "object", "field")))
        if shape == "array":
            return kind, b"[" * depth + b"]" * depth
        if shape == "object":
            return kind, b'{"a":' * depth + b"1" + b"}" * depth
        return kind, b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == "nul":
        text = draw(st.text(max_size=8)) + "\x00" + draw(st.text(max_size=8))
        raw = draw(st.booleans())  # a raw NUL inside a JSON string is invalid JSON
        encoded = b'"%s"' % text.encode("utf-8", "surrogatepass") if raw else _dump(text)
        key = draw(st.sampled_from((b"prompt", b"stop", b"pro\\u0000mpt")))
        return kind, b'{"%s": %s}' % (key, encoded)
    if kind == "utf8":
        bad = draw(st.sampled_from(BAD_UTF8) | st.just(b"\\ud800") | st.just(b"\\udfff\\ud800"))
        return kind, b'{"prompt": "ab%scd"}' % bad
    if kind == "oversize":
        size = draw(st.integers(max_body_bytes, 4 * max_body_bytes))
        return kind, b'{"prompt": "' + b"a" * size + b'"}'
    body = _valid(path, prompt, draw(st.integers(1, 4)), draw(st.booleans()))
    if kind == "constraint":
        body.update(_constrained(path, draw(constraints)))
    return kind, _dump(body)


def _constrained(path: str, constraint: dict[str, Any]) -> dict[str, Any]:
    """The fields that carry ``constraint`` (a native one) on ``path``: as it is on the
    native routes, a ``response_format`` on the OpenAI ones (a regex or grammar has no
    OpenAI form: sent as a schema's string pattern, or as the native field, refused)."""
    if path in ("/v1/stream", "/v1/generate"):
        return {"constraint": constraint}
    if constraint.get("type") == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": constraint.get("schema")}}}
    if constraint.get("type") == "regex":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": constraint.get("pattern")}}}}
    if constraint.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    return {"constraint": constraint}


def _valid(path: str, prompt: str, tokens: int, stream: bool) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                "stream": stream}
    if path == "/v1/completions":
        return {"prompt": prompt, "max_tokens": tokens, "stream": stream}
    return {"prompt": prompt, "max_new_tokens": tokens}


@st.composite
def cases(
    draw: st.DrawFn, *, max_body_bytes: int = 4096, max_pace_s: float = 0.002,
    max_cut: int = 40, silent: bool = False, framings: tuple[Framing, ...] = tuple(Framing),
) -> HostileCase:
    """One hostile request. ``silent``: a slowloris may go silent instead of sending FIN
    (the server's own timeout must end it: seconds). ``framings``: those to draw from."""
    path = draw(st.sampled_from(ROUTES))
    kind, body = draw(bodies(path, max_body_bytes))
    weights = {Framing.LENGTH: 5, Framing.CHUNKED: 2}
    framing = draw(st.sampled_from([f for f in framings for _ in range(weights.get(f, 1))]))
    case = HostileCase(kind, path, body, draw(content_types), framing,
                       connection_close=draw(st.integers(0, 3)) == 0)
    if framing is Framing.CHUNKED:
        return _replace(case, chunks=tuple(draw(st.lists(st.integers(1, 64), max_size=8))),
                        bad_chunk=draw(st.integers(0, 5)) == 0)
    if framing is Framing.SHORT:
        # Past 64 KiB declared, hypercorn 0.18 (trio) has crashed (tests/test_fuzz_http.py).
        return _replace(case, missing=draw(st.integers(1, 10_000) | st.integers(10_000, 2**20)))
    if framing is Framing.SLOWLORIS:
        head_size = len(case.head("127.0.0.1"))
        return _replace(case, cut=draw(st.integers(1, min(max_cut, head_size - 1))),
                        pace_s=draw(st.floats(0, max_pace_s)),
                        fin=not silent or draw(st.booleans()))
    return case


def _replace(case: HostileCase, **changes: Any) -> HostileCase:
    return HostileCase(**{**asdict(case), "framing": case.framing, **changes})


def sample_cases(count: int, seed_value: int, **options: Any) -> list[HostileCase]:
    """``count`` cases drawn by hypothesis from ``cases(**options)``, repeatably."""
    drawn: list[HostileCase] = []

    @seed(seed_value)
    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(cases(**options))
    def collect(case: HostileCase) -> None:
        drawn.append(case)

    collect()
    return drawn[:count]
