"""The rebuild spec survives the store: every request field and every policy reads back
as it was written (issue 23: a request's ``policy`` once made ``spec_of`` raise)."""

from __future__ import annotations

import json

import pytest

from engine import GenerationRequest, SamplingParams
from streams import PolicyName
from streams.resume import policy_of, request_of, spec_of


def stored(request: GenerationRequest, policy: PolicyName | None) -> dict[str, object]:
    """The spec as another replica reads it: bytes through JSON, as the store keeps it."""
    spec: dict[str, object] = json.loads(spec_of(request, policy).decode())
    return spec


@pytest.mark.parametrize("policy", [None, *PolicyName])
def test_every_policy_reads_back_as_the_policy_it_was(policy: PolicyName | None) -> None:
    request = GenerationRequest("r1", "", 4, prompt_token_ids=(1, 2, 3))

    read = policy_of(stored(request, policy))

    assert read is policy  # the enum member itself, which the hub's policy table needs


def test_every_request_field_reads_back_as_it_was() -> None:
    request = GenerationRequest(
        "r2", "", 7, stop=("\n\n", "END"), prompt_token_ids=(5, 6, 7, 8),
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=12345,
                                ignore_eos=True),
    )

    rebuilt = request_of("r2", stored(request, PolicyName.DROP))

    assert rebuilt == request


def test_a_policy_this_replica_does_not_know_is_refused() -> None:
    spec = stored(GenerationRequest("r3", "", 1, prompt_token_ids=(1,)), None)

    with pytest.raises(ValueError, match="naive"):
        policy_of({**spec, "policy": "naive"})
