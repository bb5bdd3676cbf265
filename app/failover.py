"""Failover: what a resumable stream's owner publishes, and its rebuild on another replica.

With a shared resume store (``STREAMSCOPE_RESUME_STORE``), a resumable stream's owner
publishes a spec with its first event (``spec_of``: the request as the engine got it,
its prompt's token ids, and the seed of a sampled request, chosen here when the client
gave none, so that even an unseeded stream continues identically) and holds an owner
lease (``STREAMSCOPE_OWNER_LEASE_S``). If the owner dies, a resume on another replica
takes the stream over (``streams/resumption.py``: an atomic operation of the store) and
calls ``Rebuilder``: it reads the token ids the logged ``token`` events carry, opens the
stream on this replica's engine continuing after them (``Engine.submit(resume_from=)``:
the tokens that follow are the uninterrupted run's), and hands it to the registry,
whose log numbers its events after the logged ones. Knows the wire events and the
``Runtime``; the engine only through its root package.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

from engine import GenerationRequest, SamplingParams
from streams import PolicyName, SSEParser, TokenStream
from streams.resumption import Adopt

from .errors import ApiError, ErrorType
from .lifespan import Runtime
from .metrics import Metrics

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
        "policy": policy,
    }, separators=(",", ":")).encode()


def request_of(request_id: str, spec: dict[str, Any]) -> GenerationRequest:
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


class Rebuilder:
    """``streams.Rebuild`` for this app: open a taken-over stream again (see the module
    docstring)."""

    def __init__(self, runtime: Runtime, metrics: Metrics) -> None:
        self._runtime = runtime
        self._metrics = metrics

    async def __call__(self, request_id: str, spec: bytes,
                       events: list[tuple[int, bytes, bool]], adopt: Adopt) -> None:
        """Raises: ApiError 503 (not ready, stopping; or a spec this replica cannot
        read), or what ``Runtime.open_stream`` raises. Cancellation: before the open,
        nothing was submitted; the open and ``adopt`` have no checkpoint between."""
        from .resumable import ResumableEncoder  # resumable.py imports this module

        try:
            parsed = json.loads(spec)
            request = request_of(request_id, parsed)
            tokens = generated_ids(events)
        except (ValueError, KeyError, TypeError) as exc:
            raise ApiError(ErrorType.UNAVAILABLE,
                           f"cannot continue this stream here: {exc}") from None
        timer = self._metrics.start_request()

        class Owner:
            @staticmethod
            def own(stream: TokenStream) -> None:
                timer.submitted(stream.prompt_tokens)
                adopt(stream, ResumableEncoder(request_id, stream.prompt_tokens), timer)

        try:
            await self._runtime.open_stream(request, parsed["policy"], owner=Owner(),
                                            resume_from=tokens)
        except BaseException:
            timer.close()
            raise
