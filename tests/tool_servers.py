"""The server the tool tests share: the tiny random model, a ChatML template, big bodies.

Used by ``test_tools_openai.py`` and ``test_tools_anthropic.py``, each through fixtures
of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import pydantic

from app.settings import Settings
from engine import Constraint, ConstraintKind, GenerationRequest
from engine.engine import Engine
from engine.model import LoadedModel
from tests.http_server import RecordingEngine, RunningServer, StartServer
from tests.test_openai_sdk import with_chat_template

MODEL = "tiny"
# A safety net only: the first constrained step of a process imports and prepares the
# mask kernels (seconds on a busy machine); ``constrain_once`` pays that before the tests.
CLIENT_TIMEOUT_S = 120.0
BIG_BODIES = 64 * 1024  # tool definitions make bodies larger than the default tests' 4 KiB


# Weather's arguments in few tokens (no docstring: it would be the tool's description):
# the tiny model's context is 512 positions.
class Wx(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    c: Literal["P", "R"]
    d: int = pydantic.Field(ge=1, le=7)


def tool_engine(loaded: LoadedModel) -> Callable[[Settings], RecordingEngine]:
    def make(s: Settings) -> RecordingEngine:
        return RecordingEngine(Engine(loaded, max_batch=s.max_batch,
                                      num_blocks=s.cache_blocks, block_size=s.block_size))

    return make


def constrain_once(loaded: LoadedModel) -> None:
    """Constrained answers (one row, then two) before the servers start, so that no
    test's is the process's first (which imports and prepares the mask kernels)."""
    engine = Engine(loaded, max_batch=4, num_blocks=16, block_size=16)
    for rows in (1, 2):
        for n in range(rows):
            engine.submit(GenerationRequest(f"warm-up-{rows}-{n}", "Hi", 3,
                                            constraint=Constraint(ConstraintKind.JSON_OBJECT)))
        while engine.has_work():
            engine.step()


async def start_tool_server(start_server: StartServer, loaded: LoadedModel,
                            **settings: Any) -> RunningServer:
    """A server of ``loaded`` with a ChatML template, bodies up to 64 KiB."""
    return await start_server(make_engine=tool_engine(with_chat_template(loaded)),
                              model_name=MODEL, max_body_bytes=BIG_BODIES, **settings)
