"""The server's life, without Quart: phases and refusals (``phase.py``), the engine's
loading (``loading.py``), the tokenizer's work (``prompts.py``), the drain and the
hand-over of resumable streams (``draining.py``), the resume log and its health
(``store.py``), /stats (``stats.py``) and the ``Runtime`` that holds them (``runtime.py``);
and the Responses API's stored responses: the record (``stored_response.py``) and the
stores that keep it (``responses_store.py``).

Other packages import these names from here, not from the modules.
"""

from .draining import HANDOVER_LEAD_S, stop_deadline_s
from .loading import MakeEngine, MakeHub, ServingEngine, load_engine_from_settings
from .phase import LOADING_RETRY_AFTER_S, SHUTDOWN_RETRY_AFTER_S, Phase
from .rebuild import Rebuilder
from .responses_store import (
    ResponsesFull,
    ResponseStore,
    ResponseStoreUnavailable,
    StoreBounds,
    response_store,
)
from .runtime import Prepared, Runtime
from .store import STORE_CHECK_TIMEOUT_S
from .stored_response import OutputParsing, StoredResponse

__all__ = [
    "HANDOVER_LEAD_S",
    "LOADING_RETRY_AFTER_S",
    "SHUTDOWN_RETRY_AFTER_S",
    "STORE_CHECK_TIMEOUT_S",
    "MakeEngine",
    "MakeHub",
    "OutputParsing",
    "Phase",
    "Prepared",
    "Rebuilder",
    "ResponseStore",
    "ResponseStoreUnavailable",
    "ResponsesFull",
    "Runtime",
    "ServingEngine",
    "StoreBounds",
    "StoredResponse",
    "load_engine_from_settings",
    "response_store",
    "stop_deadline_s",
]
