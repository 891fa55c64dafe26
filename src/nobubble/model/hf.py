"""Hugging Face causal language models as pipeline stages (the optional extra ``nobubble[hf]``).

A stage holds its slice of the model's modules under their own names (``model.layers.4...``,
``lm_head.weight``) and shares them with the model: no copy is made, and training the stages
trains the model, which ``transformers`` can then save and reload as it is. Only the hidden
states cross a stage boundary; each stage recomputes what is cheaper to recompute than to send:
the positions, the rotary tables and the causal mask.

Supported families (``FAMILIES``, one ``nobubble.model.hf_stages.LAYOUTS`` entry each): Llama
(SmolLM2 is a Llama config), Mistral, Qwen2, Qwen3, GPT-2, Gemma, Gemma 2, Gemma 3's text model
(``gemma3_text``), Phi-3, OLMo 2 and GPT-NeoX. ``check_model`` refuses, by name and before any
work, what the stages would not compute as the model's own forward does: another family, a
model without a head, bidirectional or cross-attention, an attention implementation other than
eager and sdpa, a layer type without a mask. The inputs are token ids (batch, seq) of packed
sequences, with no padding mask, as in pretraining.

Tied input and output embeddings (GPT-2, SmolLM2) are one parameter in the model. Split over
several stages, the first stage owns the embedding and the last the head, so the head gets a
copy that the last stage declares tied (``tied_parameters``): a synchronous pipeline adds both
copies' gradients before every step, so they take the same step and stay bitwise equal, and
``export`` ties them again. Asynchronous schedules refuse that (the copies would be updated at
different times); ``untie=True`` (``--untie-embeddings``) makes them two parameters from then on,
a different model that ``export`` writes with ``tie_word_embeddings`` false.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nobubble.core.errors import MissingExtra
from nobubble.model.hf_stages import LAYOUTS, attention_types

logger = logging.getLogger(__name__)

FAMILIES = tuple(LAYOUTS)
ATTENTION = ("eager", "sdpa")  # the attention implementations the conformance suite checks
# GPU kernels the stages reach through the model's own mask helpers and attention modules, as the
# model's forward does; they cannot run on the CPU the suite runs on, so a warning says so
GPU_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def require_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise MissingExtra(
            "Hugging Face models need the transformers package: pip install 'nobubble[hf]'"
        ) from exc
    return transformers


def check_installed() -> None:
    """Refuse early, without importing it, when transformers is missing."""
    import importlib.util

    try:
        found = importlib.util.find_spec("transformers") is not None
    except (ValueError, ImportError):  # a module set to None in sys.modules, a broken install
        found = False
    if not found:
        raise MissingExtra(
            "Hugging Face models need the transformers package: pip install 'nobubble[hf]'"
        )


def is_hf_model(model: Any) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "model_type")


def model_folder(path: str) -> Path:
    p = Path(path)
    if p.is_file() and p.name == "config.json":
        return p.parent
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(
                f"hf:{path} is a folder without a config.json: pass a model folder saved by "
                "transformers (save_pretrained) or a config.json"
            )
        return p
    if re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        raise FileNotFoundError(
            f"hf:{path} looks like a hub id, and there is no local folder of that name; "
            "nobubble does not download: fetch it first (huggingface-cli download "
            f"{path} --local-dir DIR) and pass hf:DIR"
        )
    raise FileNotFoundError(f"hf:{path} does not exist: pass a model folder or a config.json")


def read_config(path: str) -> dict[str, Any]:
    """The config.json of the model at ``path``, read without transformers (for checks)."""
    folder = model_folder(path)
    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"hf:{path}: config.json is not valid JSON ({err})") from None
    check_family(str(config.get("model_type")))
    return config


def config_layers(config: dict[str, Any]) -> int:
    return int(config.get("num_hidden_layers", config.get("n_layer", 0)))


def config_vocab(config: dict[str, Any]) -> int:
    return int(config["vocab_size"])


def load_model(path: str, seed: int = 0) -> Any:
    """The causal LM at ``path`` (a local folder or its config.json), in fp32.

    A folder with weights loads them; a config alone gets a random init from ``seed``.
    Nothing is downloaded.
    """
    transformers = require_transformers()
    folder = model_folder(path)
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    check_family(config.model_type)
    if any((folder / name).is_file() for name in WEIGHT_FILES):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, dtype=torch.float32
        )
    else:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train()


def meta_model(path: str) -> Any:
    """The causal LM of ``path``'s config built on the meta device (fp32, no memory): split it,
    then ``nobubble.materialize`` each process's stages (``weights_of(path)`` or a seed)."""
    transformers = require_transformers()
    config = transformers.AutoConfig.from_pretrained(model_folder(path), local_files_only=True)
    check_family(config.model_type)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train()


def weights_of(path: str) -> Path | None:
    """The folder of ``path``'s safetensors weights (one file or sharded with its index), or
    None for a config alone. Weights only as pytorch_model.bin cannot be read a tensor at a
    time: a ValueError says how to convert them."""
    folder = model_folder(path)
    if (folder / "model.safetensors").is_file() or (
        folder / "model.safetensors.index.json"
    ).is_file():
        return folder
    if any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ValueError(
            f"hf:{path} holds its weights as pytorch_model.bin, which every process would "
            "have to read whole: save it as safetensors first (AutoModelForCausalLM."
            "from_pretrained(DIR).save_pretrained(DIR2)) and pass hf:DIR2"
        )
    return None


def check_family(model_type: str) -> None:
    if model_type == "gemma3":
        raise ValueError(
            "Hugging Face model type 'gemma3' is Gemma 3 with its vision tower; nobubble trains "
            "its text model: build Gemma3ForCausalLM from the text_config (model type "
            "'gemma3_text')"
        )
    if model_type not in FAMILIES:
        raise ValueError(
            f"Hugging Face model type {model_type!r} is not supported yet; supported: "
            f"{', '.join(FAMILIES)}. Another model can pass its own list of stage modules to "
            "nobubble.Pipeline"
        )


_NOT_CAUSAL = (  # (field, its causal value, what another value does)
    ("use_bidirectional_attention", False, "lets every token see later ones (an encoder)"),
    ("is_causal", True, "makes the masks bidirectional (an encoder)"),
    ("add_cross_attention", False, "adds cross-attention over an encoder's states"),
)


def check_model(model: Any) -> None:
    """Refuse, by name, a model or config field that the stages would not compute as the
    model's own forward does (each refusal is tested in tests/test_hf_conformance.py)."""
    config = model.config
    check_family(config.model_type)
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        raise ValueError(
            f"{type(model).__name__} has no lm_head: nobubble splits causal LMs; pass the "
            f"...ForCausalLM of this {config.model_type} model"
        )
    impl = getattr(config, "_attn_implementation", None)
    if impl in GPU_ATTENTION:
        logger.warning(
            "%s: attn_implementation=%r runs through the model's own mask helpers and attention, "
            "but the conformance suite checks only %s (CPU)",
            config.model_type, impl, ", ".join(ATTENTION),
        )  # fmt: skip
    elif impl not in ATTENTION:
        raise ValueError(
            f"{config.model_type} config: attn_implementation={impl!r} is not checked through "
            f"nobubble's stages; use one of {', '.join((*ATTENTION, *GPU_ATTENTION))} "
            "(from_config(config, attn_implementation='sdpa'))"
        )
    for field, causal, why in _NOT_CAUSAL:
        value = getattr(config, field, causal)
        if value not in (causal, None):
            raise ValueError(
                f"{config.model_type} config: {field}={value!r} {why}; nobubble's stages "
                f"train causal LMs on next tokens: set {field}={causal!r}"
            )
    attention_types(config)  # an attention type without a mask maker is refused there


# ----- the layout of each family -----------------------------------------------------------
def block_layout(model: Any) -> tuple[str, nn.ModuleList]:
    """The prefix of the repeated blocks and the blocks."""
    layout = LAYOUTS[model.config.model_type]
    return f"{layout.base}.{layout.blocks}", getattr(getattr(model, layout.base), layout.blocks)


def tied_names(model: Any) -> tuple[str, str] | None:
    """(embedding, head) parameter names when the model ties them (one parameter), else None."""
    if model.get_input_embeddings().weight is not model.lm_head.weight:
        return None
    return embedding_names(model.config.model_type)


def embedding_names(model_type: str) -> tuple[str, str]:
    """The (input embedding, head) weight names of a family."""
    layout = LAYOUTS[model_type]
    return f"{layout.base}.{layout.tokens}.weight", "lm_head.weight"


def stored_names(model: Any) -> dict[str, str]:
    """The tensors that a family's weight files hold under another name than the module's
    (GPT-NeoX's head is saved as ``embed_out.weight``, as Pythia's checkpoints name it)."""
    layout = LAYOUTS.get(getattr(getattr(model, "config", None), "model_type", None) or "")
    return dict(layout.stored_as) if layout is not None and is_hf_model(model) else {}


def untie_embeddings(model: Any) -> None:
    """Give the head its own copy of the tied weights; the config says so from now on."""
    if tied_names(model) is None:
        return
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False


def export(model: Any, out: str | Path) -> Path:
    """Write ``model`` as a transformers folder (``from_pretrained(out)`` loads it).

    A model whose config ties the embeddings and whose head was a separate copy during
    pipelined training is tied again first; the two copies must be bitwise equal.
    """
    out = Path(out)
    embed = model.get_input_embeddings()
    if model.config.tie_word_embeddings and model.lm_head.weight is not embed.weight:
        if not torch.equal(model.lm_head.weight, embed.weight):
            raise ValueError(
                "the config ties lm_head.weight to the input embedding, but the two copies "
                "differ: they were trained apart (untie=True sets tie_word_embeddings false)"
            )
        model.lm_head.weight = embed.weight
    model.save_pretrained(out, safe_serialization=True)
    meta = {"written_by": "nobubble", "tie_word_embeddings": bool(model.config.tie_word_embeddings)}
    (out / "nobubble.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out
