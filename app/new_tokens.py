"""How many new tokens a request may generate: its own limit, or what the context leaves.

Peers agree on the shape (issue 45): OpenAI and vLLM give a request that names no limit
whatever the model's context leaves after its prompt, and refuse one only when the
prompt and the limit together exceed the context, naming both numbers (vLLM's 400);
llama.cpp clamps. Here:

* the limit a request may name is the model's context (the engine's ``max_positions``:
  the model's positions, or fewer if the whole KV cache holds fewer), capped lower by
  the operator's ``STREAMSCOPE_MAX_NEW_TOKENS_LIMIT`` if set; the schemas refuse what
  is over that cap (``app.schemas.limits.check_new_tokens``), and ``fit_new_tokens``
  what the prompt leaves no room for, once the prompt's tokens are counted;
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
    gets in a ``context`` of that many positions: its own limit if that fits with the
    prompt, else the refusal; ``UNTIL_CONTEXT``: what the context leaves, capped by
    ``default`` (else ``cap``) when set.

    Raises:
        ApiError: invalid_request naming ``field``, the numbers and the context; or
            prompt_too_long when the prompt leaves no position to generate in.
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
    if asked > room:
        raise ApiError(
            ErrorType.INVALID_REQUEST,
            f"{field} is {asked}, and the prompt has {prompt} tokens: together "
            f"{asked + prompt}, over the model's context of {context} tokens (at most "
            f"{room} new tokens for this prompt)",
            detail={"param": field})
    return request
