"""``naive``: the slow-reader "policy" where everyone pays for one slow reader.

The reference chapter's counter-example, kept to be measured (the ``slowclient``
experiment): after every engine step the step loop waits until each naive stream's
reader took every item, so one reader that does not read stalls every stream. It is no
policy of the service (``streams.PolicyName`` lacks it, and a request naming it gets
the same 400 as any unknown policy); the lab installs it through the hub's public seam,
a ``streams.StepGate``, on a lab server started with ``STREAMSCOPE_LAB_POLICY=naive``,
whose streams otherwise behave as ``unbounded`` (the queue grows; nobody is paused or
dropped), as the naive policy's did.
"""

from __future__ import annotations

from engine import GenerationRequest
from streams import PolicyName

NAIVE = "naive"
# What a naive stream's queue does: grow without limit (the step loop bounds it).
NAIVE_QUEUE_POLICY = PolicyName.UNBOUNDED
# Every policy the slowclient experiment measures: the lab's first, then the service's.
LAB_POLICIES = (NAIVE, *(p.value for p in PolicyName))


class NaiveGate:
    """``streams.StepGate`` of the naive policy: the step loop waits for the reader of
    every stream that uses the server's default policy (a request that picks a policy
    of its own is not naive, as on a server whose default policy was naive)."""

    def waits_for(self, request: GenerationRequest, policy: PolicyName | None) -> bool:
        return policy is None
