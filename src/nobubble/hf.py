"""``nobubble.hf``: the public path to Hugging Face causal LMs (the optional extra
``nobubble[hf]``).

This module only re-exports; the code lives by layer: loading, tied embeddings and ``export`` in
``nobubble.model.hf``, the stage modules in ``nobubble.model.hf_stages``, the cut into stages and
its balance in ``nobubble.api.split_hf`` (``nobubble.split`` takes these models too).
"""

from nobubble.api.split_hf import split_balance, split_hf
from nobubble.model.hf import (
    FAMILIES,
    WEIGHT_FILES,
    check_family,
    check_installed,
    check_model,
    config_layers,
    config_vocab,
    embedding_names,
    export,
    is_hf_model,
    load_model,
    meta_model,
    read_config,
    require_transformers,
    tied_names,
    untie_embeddings,
    weights_of,
)
from nobubble.model.hf_stages import LAYOUTS, HFStage, Layout

__all__ = [
    "FAMILIES",
    "LAYOUTS",
    "WEIGHT_FILES",
    "HFStage",
    "Layout",
    "check_family",
    "check_installed",
    "check_model",
    "config_layers",
    "config_vocab",
    "embedding_names",
    "export",
    "is_hf_model",
    "load_model",
    "meta_model",
    "read_config",
    "require_transformers",
    "split_balance",
    "split_hf",
    "tied_names",
    "untie_embeddings",
    "weights_of",
]
