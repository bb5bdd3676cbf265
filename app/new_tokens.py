"""How many new tokens a request may generate: its own limit, or what the context leaves.

Peers (issue 45): OpenAI and vLLM give a request that names no limit whatever the
model's context leaves after its prompt; vLLM refuses one whose prompt and limit
together exceed the context, naming both numbers; llama.cpp clamps the limit to what
is left. Clients send 4,096 to 32,000 whatever the model (Anthropic's API requires a
``max_tokens``), so here:

* the limit a request may name is the model's context (the engine's ``max_positions``:
  the model's positions, or fewer if the whole KV cache holds fewer), capped lower by
  the operator's ``STREAMSCOPE_MAX_NEW_TOKENS_LIMIT`` if set. The schemas refuse what is
  over that cap (``app.schemas.limits.check_new_tokens``), ``fit_new_tokens`` what is
  over the context, naming the field and both numbers;
* a limit within the context that the prompt leaves no room for is clamped to what it
  leaves (llama.cpp's way: ``max_tokens`` 8,192 with a short prompt is served, and ends
  ``length`` at the context's end at the latest); a prompt that leaves no room at all is
  refused (``prompt_too_long``);
* a request that names none gets ``UNTIL_CONTEXT`` from its schema, and
  ``fit_new_tokens`` replaces it with what the context leaves, capped by
  ``STREAMSCOPE_DEFAULT_MAX_NEW_TOKENS`` (or else the cap) if set.

Both happen in ``Runtime.prepare``, right after the prompt is encoded and beside the
engine's own check of the same budget (``Engine.check_budget``, which stays the last
word at the submit). A long limit holds nothing in advance: KV blocks are taken as the
tokens come (admission on demand, preemption, each key's share), so it does not starve
short requests (docs/api.md has the capacity lab's figures).

A refusal is an ``ApiError`` (``invalid_request``: 400 on the OpenAI and Anthropic
routes, 422 on ours) whose ``param`` names the request's own field (``max_tokens``,
``max_output_tokens``, ...).
"""

from __future__ import annotations

from dataclasses import replace

import engine

from .errors import ApiError, ErrorType

UNTIL_CONTEXT = 0
"""``max_new_tokens`` of a request that named no limit, until ``fit_new_tokens`` fills it
in. The engine refuses 0, so a request that skipped the fill cannot run unbounded."""


def fit_new_tokens(
    request: engine.GenerationRequest, context: int, *, cap: int | None,
    default: int | None, field: str,
) -> engine.GenerationRequest:
    """``request`` (its prompt encoded: ``prompt_token_ids`` set) with the new tokens it
    gets in a ``context`` of that many positions: its own limit, at most what the prompt
    leaves; ``UNTIL_CONTEXT``: what the prompt leaves, capped by ``default`` (else
    ``cap``) when set.

    Raises:
        ApiError: invalid_request naming ``field``, its value and the context, for a
            limit over the context; prompt_too_long when the prompt leaves no position
            to generate in.
    """
    assert request.prompt_token_ids is not None  # encoded first (Runtime.prepare)
    prompt = len(request.prompt_token_ids)
    room = context - prompt
    asked = request.max_new_tokens
    if room < 1:
        raise ApiError(ErrorType.PROMPT_TOO_LONG,
                       f"the prompt has {prompt} tokens, which leaves no room for new "
                       f"tokens in the model's context of {context} tokens")
    if asked == UNTIL_CONTEXT:
        limit = default if default is not None else cap
        return replace(request, max_new_tokens=room if limit is None else min(room, limit))
    if asked > context:
        raise ApiError(
            ErrorType.INVALID_REQUEST,
            f"{field} is {asked}, over the model's context of {context} tokens, which the "
            f"prompt ({prompt} tokens here) and the new tokens share",
            detail={"param": field})
    return request if asked <= room else replace(request, max_new_tokens=room)
