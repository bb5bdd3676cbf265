"""The rebuild spec survives the store: every request field and every policy reads back
as it was written (issue 23: a request's ``policy`` once made ``spec_of`` raise), through
the very function that validates an HTTP body; and what the replicas store is signed,
so that an altered or unsigned spec or event is refused (issue 23 item 2)."""

from __future__ import annotations

from dataclasses import replace

import pydantic
import pytest

from app.schemas import RequestLimits, parse_generate_body
from engine import GenerationRequest, SamplingParams
from streams import PolicyName
from streams.resume import StoreRejected, spec_of, spec_parts
from streams.resume.signing import StoreSigner

LIMITS = RequestLimits(max_prompt_chars=100, max_new_tokens_limit=50,
                       default_max_new_tokens=8, request_policies=frozenset(PolicyName))
SECRET = "a-secret-the-replicas-share-0123456789"


def rebuilt(request: GenerationRequest, policy: PolicyName | None,
            limits: RequestLimits = LIMITS) -> tuple[GenerationRequest, PolicyName | None]:
    """The spec as another replica reads it: validated as an HTTP body is, in the
    request's cache namespace (app/runtime/rebuild.py)."""
    raw, namespace = spec_parts(spec_of(request, policy))
    body = parse_generate_body(raw, limits)
    return replace(body.generation_request(), cache_namespace=namespace), body.policy


@pytest.mark.parametrize("band", [-3, 0, 7])
def test_the_band_it_was_served_in_reads_back(band: int) -> None:
    request = GenerationRequest("r0", "Hello", 4, priority=band)

    read, _ = rebuilt(request, None)

    assert read.priority == band  # a failover keeps the stream's band (issue 48)


@pytest.mark.parametrize("policy", [None, *PolicyName])
def test_every_policy_reads_back_as_the_policy_it_was(policy: PolicyName | None) -> None:
    request = GenerationRequest("r1", "Hello", 4, prompt_token_ids=(1, 2, 3))

    _, read = rebuilt(request, policy)

    assert read is policy  # the enum member itself, which the hub's policy table needs


def test_every_request_field_reads_back_as_it_was() -> None:
    request = GenerationRequest(
        "r2", "Once upon a time", 7, stop=("\n\n", "END"), prompt_token_ids=(5, 6, 7, 8),
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=12345,
                                ignore_eos=True, logprobs=True, top_logprobs=3,
                                presence_penalty=0.5, frequency_penalty=-1.25,
                                repetition_penalty=1.2, logit_bias=((7, 3.5), (2, -100.0))),
        cache_namespace=bytes(range(32)),  # the key's: a rebuilt stream finds its blocks
    )

    read, _ = rebuilt(request, PolicyName.DROP)

    # The prompt's ids are not read back: the replica that rebuilds encodes the prompt.
    expected = GenerationRequest("r2", request.prompt, 7, stop=request.stop,
                                 sampling=request.sampling,
                                 cache_namespace=request.cache_namespace)
    assert replace(read, request_id="r2") == expected


@pytest.mark.parametrize(("limits", "policy", "what"), [
    (replace(LIMITS, max_new_tokens_limit=6, default_max_new_tokens=6), None,
     "max_new_tokens"),
    (replace(LIMITS, max_prompt_chars=3), None, "prompt"),
    (replace(LIMITS, request_policies=frozenset({PolicyName.DROP})), PolicyName.PAUSE,
     "policy"),
])
def test_a_spec_over_this_replicas_limits_is_refused(
    limits: RequestLimits, policy: PolicyName | None, what: str,
) -> None:
    request = GenerationRequest("r3", "Hello", 7)

    with pytest.raises(pydantic.ValidationError, match=what):
        rebuilt(request, policy, limits)


def test_too_many_or_too_long_stop_strings_are_refused() -> None:
    for stop in (tuple(f"s{i}" for i in range(9)), ("x" * 65,)):
        with pytest.raises(pydantic.ValidationError, match="stop"):
            rebuilt(GenerationRequest("r4", "Hello", 4, stop=stop), None)


def test_a_signed_spec_opens_only_as_it_was_written_for_its_stream() -> None:
    signer = StoreSigner(SECRET)
    stored = signer.sign_spec("s1", b'{"prompt":"x"}')

    assert signer.open_spec("s1", stored) == b'{"prompt":"x"}'
    for forged, stream in [(stored, "s2"),  # copied to another stream's key
                           (stored.replace(b'"x"', b'"y"'), "s1"),  # altered
                           (b'{"prompt":"x"}', "s1"),  # unsigned
                           (StoreSigner("another-" + SECRET).sign_spec("s1", b"{}"), "s1")]:
        with pytest.raises(StoreRejected, match="HMAC"):
            signer.open_spec(stream, forged)


def test_an_event_checks_only_with_its_stream_number_flag_and_bytes() -> None:
    signer = StoreSigner(SECRET)
    mac = signer.event_mac("s1", 3, b"data", False)

    signer.check_event("s1", 3, b"data", False, mac)
    for stream, n, data, last, m in [
        ("s2", 3, b"data", False, mac), ("s1", 4, b"data", False, mac),
        ("s1", 3, b"date", False, mac), ("s1", 3, b"data", True, mac),
        ("s1", 3, b"data", False, None),
    ]:
        with pytest.raises(StoreRejected):
            signer.check_event(stream, n, data, last, m)


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="32"):
        StoreSigner("x" * 31)

