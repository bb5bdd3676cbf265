"""The engine's exceptions: one type per kind of bad input, raised before admission.

EngineError
├── InvalidRequest            the request can never be served as given
│   ├── EmptyPrompt           the prompt has no tokens
│   ├── InvalidTokenId        a given token id is not in the model's vocabulary
│   ├── InvalidMaxNewTokens   max_new_tokens < 1
│   ├── PromptTooLong         prompt + max_new_tokens exceed the cache or the model's context
│   ├── InvalidSampling       temperature, top_p, top_k or seed out of range
│   ├── DuplicateRequestId    the id is already in the engine
│   └── ChatTemplateError     the model has no chat template, or it refused the messages
├── DoubleRelease             a sequence's blocks were released twice (a bug, never input)
└── StepReentered             step() was called while another step ran (a bug)
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of everything the engine raises on purpose."""


class InvalidRequest(EngineError, ValueError):
    """The request can never be served as given; nothing was admitted.

    ``param``: the request's field at fault where one is (``logit_bias``), so that an
    API answers with it (OpenAI's error ``param``); None otherwise."""

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EmptyPrompt(InvalidRequest):
    pass


class InvalidTokenId(InvalidRequest):
    """A token id given to ``submit`` (``prompt_token_ids``, ``resume_from``) is not an
    integer in ``[0, vocabulary size)``: it must never reach the model, whose embedding
    lookup would fail (on a GPU, a device-side assert that ends the process's CUDA use)."""


class InvalidMaxNewTokens(InvalidRequest):
    pass


class PromptTooLong(InvalidRequest):
    pass


class InvalidSampling(InvalidRequest):
    pass


class DuplicateRequestId(InvalidRequest):
    pass


class ChatTemplateError(InvalidRequest):
    """Chat messages cannot become a prompt: the tokenizer has no chat template, or
    the template refused them (many raise on an unexpected role order)."""


class InvalidConstraint(InvalidRequest):
    """A request's constraint does not compile (a schema, regex or grammar the
    constrained-decoding library refuses): its message says where."""


class DoubleRelease(EngineError, RuntimeError):
    """Blocks of one sequence were released a second time."""


class StepReentered(EngineError, RuntimeError):
    """Two threads called step() at once; the engine has one caller."""


class PrecisionError(EngineError, ValueError):
    """The weights' precision is unknown, or the device cannot run it
    (``engine.precision``): raised by the load, before anything is built."""
