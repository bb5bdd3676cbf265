"""The rebuild spec: what a resumable stream's first event publishes so that another
replica can continue the stream identically if this one dies.

``spec_of`` writes the request as the engine got it (its prompt's token ids, and the
seed of a sampled request, chosen by ``with_seed`` when the client gave none, so that
even an unseeded stream continues identically); ``request_of`` reads it back on the
replica that takes the stream over (``policy_of`` its policy), and ``generated_ids``
recovers the token ids the logged ``token`` events carry, which the rebuilt stream
continues after. Kept beside the registry (not in ``app``) because the spec is part of
the store's stored data.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

from engine import GenerationRequest, SamplingParams

from ..policy import PolicyName
from ..sse import SSEParser

SPEC_VERSION = 1


def with_seed(request: GenerationRequest) -> GenerationRequest:
    """A sampled request without a seed gets one (as the engine would pick at random),
    so that the spec holds the seed its generator actually uses."""
    sampling = request.sampling
    if sampling.temperature == 0 or sampling.seed is not None:
        return request
    return replace(request, sampling=replace(sampling, seed=random.getrandbits(63)))


def spec_of(request: GenerationRequest, policy: PolicyName | None) -> bytes:
    """What a rebuild needs: the request with its prompt's token ids and its seed."""
    assert request.prompt_token_ids is not None  # encoded before it is published
    s = request.sampling
    return json.dumps({
        "v": SPEC_VERSION,
        "prompt_token_ids": list(request.prompt_token_ids),
        "max_new_tokens": request.max_new_tokens,
        "stop": list(request.stop),
        "sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                     "seed": s.seed, "ignore_eos": s.ignore_eos},
        "policy": None if policy is None else policy.value,  # JSON holds the name
    }, separators=(",", ":")).encode()


def request_of(request_id: str, spec: dict[str, Any]) -> GenerationRequest:
    """The request a published spec describes (``ValueError`` for another version)."""
    if spec.get("v") != SPEC_VERSION:
        raise ValueError(f"spec version {spec.get('v')!r}")
    return GenerationRequest(
        request_id=request_id,
        prompt="",  # the token ids are the prompt
        max_new_tokens=spec["max_new_tokens"],
        stop=tuple(spec["stop"]),
        sampling=SamplingParams(**spec["sampling"]),
        prompt_token_ids=tuple(spec["prompt_token_ids"]),
    )


def policy_of(spec: dict[str, Any]) -> PolicyName | None:
    """The policy a published spec names, read back through ``PolicyName`` so that the
    rebuilt stream pauses or drops as the first one did (``ValueError`` for a name this
    replica does not know)."""
    name = spec["policy"]
    return None if name is None else PolicyName(name)


def generated_ids(events: list[tuple[int, bytes, bool]]) -> list[int]:
    """The token ids of the logged ``token`` events, in order (each ``index`` checked)."""
    parser, ids = SSEParser(), list[int]()
    for _, data, _ in events:
        for event in parser.feed(data):
            if event.event == "token":
                token = json.loads(event.data)
                if token["index"] != len(ids):
                    raise ValueError(f"token {token['index']} follows {len(ids)}")
                ids.append(int(token["id"]))
    return ids
