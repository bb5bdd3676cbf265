"""The rebuild spec: what a resumable stream's first event publishes so that another
replica can continue the stream identically if this one dies.

``spec_of`` writes the request as a request body, the JSON that ``POST /v1/stream``
takes (the prompt's text, max_new_tokens, stop, the sampling fields with the seed of a
sampled request, chosen by ``with_seed`` when the client gave none so that even an
unseeded stream continues identically, its penalties and logit bias if any, the
policy's name, and the constraint: the
rebuilt stream's matcher replays the tokens it made), so that the replica that
takes the stream over validates it with the very function that validates an HTTP body
(the app's ``parse_generate_body``: every limit, the policy's allow-list) and encodes its
prompt itself: no token id of the prompt comes from the store. Beside the body it holds
the request's prefix-cache namespace (``cache_namespace``, hex; ``spec_parts`` takes it
out before the body is parsed): the rebuilt stream chains its blocks from the same root,
so it shares what its key cached and nothing of another key's. ``generated_ids`` recovers
the token ids the logged ``token`` events carry, which the rebuilt stream continues
after. The store holds the spec signed (``signing.py``), and checked before it is read.
Kept beside the registry (not in ``app``) because the spec is part of the store's data.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

from engine import Constraint, ConstraintKind, GenerationRequest

from ..policy import PolicyName
from ..sse import SSEParser

MAX_NAMESPACE_HEX = 128  # the engine's bound on a namespace, 64 bytes


def with_seed(request: GenerationRequest) -> GenerationRequest:
    """A sampled request without a seed gets one (as the engine would pick at random),
    so that the spec holds the seed its generator actually uses."""
    sampling = request.sampling
    if sampling.temperature == 0 or sampling.seed is not None:
        return request
    return replace(request, sampling=replace(sampling, seed=random.getrandbits(63)))


def spec_of(request: GenerationRequest, policy: PolicyName | None) -> bytes:
    """What a rebuild needs, as a request body: the request's fields with its seed."""
    s = request.sampling
    band = {"priority": request.priority} if request.priority else {}  # the served band
    return json.dumps(_penalties(request) | band | {
        "prompt": request.prompt,
        "max_new_tokens": request.max_new_tokens,
        "stop": list(request.stop),
        "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
        "seed": s.seed, "ignore_eos": s.ignore_eos,
        "logprobs": s.logprobs, "top_logprobs": s.top_logprobs,
        "policy": None if policy is None else policy.value,  # JSON holds the name
        "cache_namespace": request.cache_namespace.hex(),
        "constraint": None if request.constraint is None else _constraint(request.constraint),
    }, separators=(",", ":")).encode()


def _penalties(request: GenerationRequest) -> dict[str, Any]:
    """The body's penalties and ``logit_bias`` where the request has them (a request
    without them writes the spec it always did)."""
    s = request.sampling
    fields: dict[str, Any] = {}
    if s.repetition_penalty != 1.0:
        fields["repetition_penalty"] = s.repetition_penalty
    if s.presence_penalty:
        fields["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        fields["frequency_penalty"] = s.frequency_penalty
    if s.logit_bias:
        fields["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
    return fields


def spec_parts(spec: bytes) -> tuple[bytes, bytes]:
    """(the request body, the cache namespace) of a spec; a spec written before the
    namespace was has b"" (the engine's plain root). Raises: ValueError (not a JSON
    object, or a namespace that is not hex of at most ``MAX_NAMESPACE_HEX`` digits)."""
    body = json.loads(spec)
    if not isinstance(body, dict):
        raise ValueError("the spec is not a JSON object")
    namespace = body.pop("cache_namespace", "")
    if not isinstance(namespace, str) or len(namespace) > MAX_NAMESPACE_HEX:
        raise ValueError("cache_namespace: expected a hex string")
    return json.dumps(body).encode(), bytes.fromhex(namespace)


def _constraint(constraint: Constraint) -> dict[str, Any]:
    """The body's ``constraint`` object (``app.schemas.constraint``) for a constraint."""
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        return {"type": kind.value, "schema": json.loads(constraint.source)}
    if kind is ConstraintKind.JSON_OBJECT:
        return {"type": kind.value}
    key = "pattern" if kind is ConstraintKind.REGEX else "grammar"
    return {"type": kind.value, key: constraint.source}


def generated_ids(events: list[tuple[int, bytes, bool]]) -> list[int]:
    """The token ids of the logged ``token`` events, in order (each ``index`` checked;
    ``ValueError`` for anything else)."""
    parser, ids = SSEParser(), list[int]()
    for _, data, _ in events:
        for event in parser.feed(data):
            if event.event == "token":
                token = json.loads(event.data)
                token_id = token["id"]
                if token["index"] != len(ids):
                    raise ValueError(f"token {token['index']} follows {len(ids)}")
                if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                    raise ValueError(f"token id {token_id!r}")
                ids.append(token_id)
    return ids
