"""The server's life, without Quart: phases and refusals (``phase.py``), the engine's
loading (``loading.py``), the tokenizer's work (``prompts.py``), the drain and the
hand-over of resumable streams (``draining.py``), the resume log and its health
(``store.py``), /stats (``stats.py``), the Responses API's stored responses
(``responses_store.py``) and the ``Runtime`` that holds them (``runtime.py``).

Other packages import these names from here, not from the modules.
"""

from .draining import HANDOVER_LEAD_S, stop_deadline_s
from .loading import MakeEngine, ServingEngine, load_engine_from_settings
from .phase import LOADING_RETRY_AFTER_S, SHUTDOWN_RETRY_AFTER_S, Phase
from .rebuild import Rebuilder
from .responses_store import (
    ResponsesFull,
    ResponseStore,
    ResponseStoreUnavailable,
    response_store,
)
from .runtime import Prepared, Runtime
from .store import STORE_CHECK_TIMEOUT_S

__all__ = [
    "HANDOVER_LEAD_S",
    "LOADING_RETRY_AFTER_S",
    "SHUTDOWN_RETRY_AFTER_S",
    "STORE_CHECK_TIMEOUT_S",
    "MakeEngine",
    "Phase",
    "Prepared",
    "Rebuilder",
    "ResponseStore",
    "ResponseStoreUnavailable",
    "ResponsesFull",
    "Runtime",
    "ServingEngine",
    "load_engine_from_settings",
    "response_store",
    "stop_deadline_s",
]
