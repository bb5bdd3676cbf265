"""The HTTP views, one family a module, each view a screenful; and the one SSE body.

* ``native``: ``/v1/stream``, ``/v1/generate``, ``GET /v1/requests/<id>``; with
  ``health``: ``/health``, ``/ready``, ``/stats``;
* ``openai``: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (errors
  and model names in ``openai_errors``);
* ``anthropic``: ``/v1/messages``, ``/v1/messages/count_tokens`` (errors in
  ``anthropic_errors``);
* ``resumable``: ``POST /v1/requests``, ``GET /v1/stream/<id>``, ``DELETE
  /v1/requests/<id>`` (a reader as a source: ``resume_source``; a dead replica's stream
  rebuilt here: ``failover``);
* ``responses``: the OpenAI Responses API, ``/v1/responses`` (stored responses in
  ``responses_stored``, background ones in ``responses_background``, the documents in
  ``responses_objects``);
* ``page``: ``GET /`` and ``/page.js``, the browser page;
* ``scope``: ``GET /scope``, its script, token and ``/scope/events``, the live view.

Every generating route is one view, ``pipeline.Pipeline.serve``, with its API's adapter
(``native.NativeAdapter``, ``openai.CompletionsAdapter`` and ``ChatAdapter``,
``anthropic.MessagesAdapter``, ``responses.ResponsesAdapter``, ``resumable
.RequestsAdapter``): a new API is one adapter module. A stream opens owned by the
request's connection (``pipeline.answer_owned``) or by the resume registry
(``registry_owned.open_registry_owned``: resumable streams and background responses).
Every streaming answer is ``body.EventStreamBody``: a source (a ``TokenStream``, or a
resumable stream's reader), an encoder (``app.wire``), the keep-alive, one farewell.
What every view does to serve a request is in ``serving``.
"""

from __future__ import annotations

from .anthropic import make_anthropic_blueprint
from .native import make_blueprint
from .openai import make_openai_blueprint
from .page import make_page_blueprint
from .responses import make_responses_blueprint
from .resumable import make_resumable_blueprint
from .scope import make_scope_blueprint

__all__ = [
    "make_anthropic_blueprint",
    "make_blueprint",
    "make_openai_blueprint",
    "make_page_blueprint",
    "make_responses_blueprint",
    "make_resumable_blueprint",
    "make_scope_blueprint",
]
