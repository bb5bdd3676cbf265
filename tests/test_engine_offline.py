"""Loading a model never reaches a model hub, and importing the engine changes nothing.

``engine.offline.hub_offline()`` sets ``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE`` and
``HF_HUB_DISABLE_TELEMETRY`` right before the engine first imports transformers (in the
functions that load or build a model), never at import. One child process, where every
connection attempt raises, imports the engine (its environment as it was), then loads
"tiny-llama" and a local transformers folder: the switches are on by then, and
huggingface_hub (which reads them once, when it is imported) saw them; the tokens are
those of the same models loaded here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict, cast

import pytest

from engine import GenerationRequest, SamplingParams, TokenEvent
from engine.engine import Engine
from engine.offline import OFFLINE_SWITCHES
from tests.engine_steps import run_until_idle

MakeEngine = Callable[..., Engine]
REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"

# Loads each model named on the command line in a process where any connection attempt
# raises, and prints what it saw of the switches and {model: token ids of PROMPT}.
OFFLINE_SCRIPT = textwrap.dedent(
    """
    import json, os, socket, sys

    def refuse(*args, **kwargs):
        raise OSError("network blocked by the test")

    socket.socket.connect = socket.socket.connect_ex = refuse
    socket.create_connection = socket.getaddrinfo = refuse

    import engine

    after_import = {name: os.environ.get(name) for name in sys.argv[2].split(",")}
    import torch

    torch.set_num_threads(1)
    from engine import GenerationRequest, SamplingParams, TokenEvent
    from engine.engine import Engine
    from engine.model import load_model

    transformers_before_load = "transformers" in sys.modules
    prompt, ids = sys.argv[1], {}
    for model in sys.argv[3:]:
        e = Engine(load_model(model, "cpu"), max_batch=1, num_blocks=8, block_size=4)
        e.submit(GenerationRequest("r", prompt, 4, sampling=SamplingParams(ignore_eos=True)))
        events = []
        while e.has_work():
            events += e.step()
        ids[model] = [event.token_id for event in events if isinstance(event, TokenEvent)]
    import huggingface_hub.constants

    print(json.dumps({
        "after_import": after_import,
        "after_load": {name: os.environ.get(name) for name in after_import},
        "transformers_before_load": transformers_before_load,
        "hub_offline": huggingface_hub.constants.HF_HUB_OFFLINE,
        "ids": ids,
    }))
    """
)


class OfflineRun(TypedDict):
    after_import: dict[str, str | None]  # the switches as the child saw them after `import engine`
    after_load: dict[str, str | None]  # and after loading the models
    transformers_before_load: bool  # whether importing the engine's modules imported it
    hub_offline: bool  # huggingface_hub's own reading of HF_HUB_OFFLINE, at its import
    ids: dict[str, list[int]]  # token ids of PROMPT per model name or folder
    folder: str


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory: pytest.TempPathFactory) -> OfflineRun:
    """One child process (importing torch costs seconds) loading "tiny-llama" and a folder.

    The folder holds the tiny GPT-2 model and tokenizer written with save_pretrained.
    """
    from engine.model import tiny_gpt2, tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny-gpt2-folder")
    tiny_gpt2().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    # Unset the switches this process set by building models: the child must get them
    # from the engine's loading path itself.
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_SWITCHES}
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE_SCRIPT, PROMPT, ",".join(OFFLINE_SWITCHES),
         "tiny-llama", str(folder)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    return cast(OfflineRun, {**seen, "folder": str(folder)})


def _solo_ids(engine: Engine) -> list[int]:
    engine.submit(GenerationRequest("r", PROMPT, 4, sampling=SamplingParams(ignore_eos=True)))
    return [e.token_id for e in run_until_idle(engine) if isinstance(e, TokenEvent)]


def test_importing_engine_sets_no_variable(offline_run: OfflineRun) -> None:
    assert offline_run["after_import"] == dict.fromkeys(OFFLINE_SWITCHES)
    assert offline_run["transformers_before_load"] is False


def test_loading_a_model_switches_the_hub_offline_before_importing_it(
    offline_run: OfflineRun,
) -> None:
    assert offline_run["after_load"] == OFFLINE_SWITCHES
    assert offline_run["hub_offline"] is True


def test_tiny_model_loads_and_steps_without_network(
    offline_run: OfflineRun, make_tiny_engine: MakeEngine
) -> None:
    assert offline_run["ids"]["tiny-llama"] == _solo_ids(make_tiny_engine("tiny-llama"))


def test_local_transformers_folder_loads_without_network(
    offline_run: OfflineRun, make_tiny_engine: MakeEngine
) -> None:
    expected = _solo_ids(make_tiny_engine())  # tiny-gpt2 in this process
    assert offline_run["ids"][offline_run["folder"]] == expected
