"""A Hugging Face model's own tokenizer, from its folder's ``tokenizer.json``, and its EOS id.

Read with the ``tokenizers`` library (a dependency of nobubble), not ``transformers``'
``AutoTokenizer``: the fast tokenizer that ``AutoTokenizer`` loads for these folders is this very
``tokenizer.json`` run by the same library, so the ids agree, while the data layer needs neither
the ``hf`` extra nor its import time. ``AutoTokenizer``'s extras (a BOS template, chat templates)
are not wanted for packing documents. A folder with only a sentencepiece ``tokenizer.model`` is
refused with the one-line conversion that writes its ``tokenizer.json``.

The EOS token is the one ``tokenizer_config.json`` names (``eos_token``), else the first
``eos_token_id`` of ``generation_config.json`` or ``config.json``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import tokenizers

from nobubble.data.tokenizer import HFTokenizer


def model_tokenizer(path: str) -> HFTokenizer:
    """The tokenizer of a Hugging Face model folder (or its ``tokenizer.json``), with its EOS id."""
    where = Path(path).expanduser()
    file = where if where.is_file() else where / "tokenizer.json"
    folder = file.parent
    if not file.is_file():
        raise ValueError(
            f"no tokenizer.json in {str(where)!r}; give the model folder that holds it. A folder "
            'with only tokenizer.model gets one from: python -c "from transformers import '
            f"AutoTokenizer as A; A.from_pretrained('{folder}').save_pretrained('{folder}')\""
        )
    tok = tokenizers.Tokenizer.from_file(str(file))
    eos_id = _eos_id(folder, tok)
    digest = hashlib.sha256(file.read_bytes()).hexdigest()[:12]
    return HFTokenizer(tok, f"hf-{digest}-eos{eos_id}", eos_id)


def _eos_id(folder: Path, tok: tokenizers.Tokenizer) -> int:
    token = _read_json(folder / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    found_id = tok.token_to_id(token) if isinstance(token, str) else None
    if found_id is not None:
        return int(found_id)
    for name in ("generation_config.json", "config.json"):
        found = _read_json(folder / name).get("eos_token_id")
        found = found[0] if isinstance(found, list) and found else found
        if isinstance(found, int) and not isinstance(found, bool):
            return found
    raise ValueError(
        f"the tokenizer in {str(folder)!r} names no EOS token (eos_token in "
        "tokenizer_config.json, or eos_token_id in generation_config.json or config.json), and "
        "documents are joined with it; add eos_token to tokenizer_config.json"
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); restore the model's file") from exc
    return data if isinstance(data, dict) else {}


def check_vocab_fits(tokenizer_vocab: int, model_vocab: int) -> None:
    """Refuse a tokenizer whose ids (``0 .. tokenizer_vocab - 1``) overrun the model's embedding."""
    if tokenizer_vocab > model_vocab:
        raise ValueError(
            f"the tokenizer's ids reach {tokenizer_vocab - 1}, but the model's vocabulary "
            f"(vocab_size) has {model_vocab} ids; use the model's own tokenizer, or a model "
            f"with vocab_size >= {tokenizer_vocab}"
        )
