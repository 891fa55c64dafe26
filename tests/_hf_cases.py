"""The tiny Hugging Face configurations of the conformance suite: every supported family, varied
over the config fields that change its forward (read from each family's modeling code in
transformers). A case is a config and an attention implementation; dropout is 0 throughout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
VOCAB, SEQ_LEN, WINDOW = 64, 16, 4  # the window is shorter than the sequence: it bites
CAP = 0.3  # soft-caps near the logits' size, so that tanh bends them


def _small(**over: Any) -> dict[str, Any]:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return {**common, **over}


def _rope(kind: str, **over: Any) -> dict[str, Any]:
    return {"rope_type": kind, "rope_theta": 10000.0, **over}


_ALTERNATING = ["sliding_attention", "full_attention"] * 2
_GEMMA3_ROPE = {  # local and global tables differ in theta and scaling, as in Gemma 3
    "sliding_attention": _rope("default"),
    "full_attention": _rope("linear", rope_theta=1e6, factor=2.0),
}

T = transformers
# name -> (config, attention implementation)
CASES: dict[str, tuple[Callable[[], Any], str]] = {
    "llama": (lambda: T.LlamaConfig(**_small()), "sdpa"),
    "llama-eager-biases": (
        lambda: T.LlamaConfig(**_small(attention_bias=True, mlp_bias=True)),
        "eager",
    ),
    "llama-tied-head-dim": (
        lambda: T.LlamaConfig(**_small(tie_word_embeddings=True, head_dim=16)),
        "sdpa",
    ),
    "llama-rope-llama3": (
        lambda: T.LlamaConfig(
            **_small(
                rope_parameters=_rope(
                    "llama3",
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=8,
                )
            )
        ),
        "sdpa",
    ),
    "llama-rope-linear": (
        lambda: T.LlamaConfig(**_small(rope_parameters=_rope("linear", factor=2.0))),
        "sdpa",
    ),
    "llama-rope-dynamic": (  # the sequence is longer than max_position_embeddings: it rescales
        lambda: T.LlamaConfig(
            **_small(max_position_embeddings=8, rope_parameters=_rope("dynamic", factor=2.0))
        ),
        "sdpa",
    ),
    "llama-rope-yarn": (
        lambda: T.LlamaConfig(
            **_small(rope_parameters=_rope("yarn", factor=2.0, original_max_position_embeddings=8))
        ),
        "sdpa",
    ),
    "mistral-window-eager": (lambda: T.MistralConfig(**_small(sliding_window=WINDOW)), "eager"),
    "qwen2-window-tied": (
        lambda: T.Qwen2Config(
            **_small(
                use_sliding_window=True,
                sliding_window=WINDOW,
                max_window_layers=2,
                tie_word_embeddings=True,
            )
        ),
        "sdpa",
    ),
    "qwen3-bias-eager": (
        lambda: T.Qwen3Config(**_small(head_dim=8, attention_bias=True)),
        "eager",
    ),
    "qwen3-window": (
        lambda: T.Qwen3Config(
            **_small(
                head_dim=8, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
            )
        ),
        "sdpa",
    ),
    "gpt2": (lambda: T.GPT2Config(**_gpt2()), "sdpa"),
    "gpt2-eager-inverse-layer-upcast": (
        lambda: T.GPT2Config(
            **_gpt2(scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True)
        ),
        "eager",
    ),
    "gpt2-unscaled-relu-untied": (
        lambda: T.GPT2Config(
            **_gpt2(
                scale_attn_weights=False,
                activation_function="relu",
                n_inner=48,
                tie_word_embeddings=False,
            )
        ),
        "sdpa",
    ),
    "gemma": (lambda: T.GemmaConfig(**_small(head_dim=8, tie_word_embeddings=True)), "sdpa"),
    "gemma-eager-bias-untied": (
        lambda: T.GemmaConfig(**_small(head_dim=16, attention_bias=True)),
        "eager",
    ),
    "gemma2": (  # Gemma 2 has no sdpa in transformers (it soft-caps attention)
        lambda: T.Gemma2Config(
            **_small(
                head_dim=8,
                tie_word_embeddings=True,
                sliding_window=WINDOW,
                layer_types=_ALTERNATING,
                query_pre_attn_scalar=16,
                final_logit_softcapping=CAP,
                attn_logit_softcapping=CAP,
            )
        ),
        "eager",
    ),
    "gemma2-uncapped-full": (
        lambda: T.Gemma2Config(
            **_small(
                head_dim=8,
                layer_types=["full_attention"] * 4,
                final_logit_softcapping=None,
                attn_logit_softcapping=None,
            )
        ),
        "eager",
    ),
    "gemma3": (
        lambda: T.Gemma3TextConfig(
            **_small(
                head_dim=8,
                tie_word_embeddings=True,
                sliding_window=WINDOW,
                layer_types=_ALTERNATING,
                query_pre_attn_scalar=8,
                rope_parameters=_GEMMA3_ROPE,
            )
        ),
        "sdpa",
    ),
    "gemma3-capped-eager": (
        lambda: T.Gemma3TextConfig(
            **_small(
                head_dim=8,
                sliding_window=WINDOW,
                layer_types=["full_attention", "sliding_attention"] * 2,
                rope_parameters=_GEMMA3_ROPE,
                final_logit_softcapping=CAP,
                attn_logit_softcapping=CAP,
                attention_bias=True,
            )
        ),
        "eager",
    ),
    "phi3-window-partial": (
        lambda: T.Phi3Config(
            **_small(
                sliding_window=WINDOW,
                tie_word_embeddings=True,
                rope_parameters=_rope("default", partial_rotary_factor=0.5),
            )
        ),
        "sdpa",
    ),
    "phi3-longrope-eager": (  # longer than original_max_position_embeddings: the long factors
        lambda: T.Phi3Config(
            **_small(
                max_position_embeddings=4 * SEQ_LEN,
                original_max_position_embeddings=8,
                rope_parameters=_rope(
                    "longrope",
                    partial_rotary_factor=0.5,
                    short_factor=[1.0, 1.5],
                    long_factor=[2.0, 3.0],
                ),
            )
        ),
        "eager",
    ),
    "olmo2": (lambda: T.Olmo2Config(**_small()), "sdpa"),
    "olmo2-eager-bias-tied-linear": (
        lambda: T.Olmo2Config(
            **_small(
                attention_bias=True,
                tie_word_embeddings=True,
                rope_parameters=_rope("linear", factor=2.0),
            )
        ),
        "eager",
    ),
    "gpt_neox": (  # Pythia's layout: parallel residual, a quarter of each head rotated
        lambda: T.GPTNeoXConfig(**_neox()),
        "sdpa",
    ),
    "gpt_neox-sequential-eager-tied": (
        lambda: T.GPTNeoXConfig(
            **_neox(
                use_parallel_residual=False,
                attention_bias=False,
                tie_word_embeddings=True,
                rope_parameters=_rope("default", partial_rotary_factor=1.0),
            )
        ),
        "eager",
    ),
}


def _gpt2(**over: Any) -> dict[str, Any]:
    common = dict(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=4,
        n_head=4,
        n_positions=SEQ_LEN,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return {**common, **over}


def _neox(**over: Any) -> dict[str, Any]:
    small = _small(rope_parameters=_rope("default", partial_rotary_factor=0.25))
    del small["num_key_value_heads"]  # GPT-NeoX has no grouped queries
    return {**small, "hidden_dropout": 0.0, "attention_dropout": 0.0, **over}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """Case ``name``'s model, built as a user builds it, in fp32 and training mode."""
    config, attention = CASES[name]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config(), attn_implementation=attention, dtype=torch.float32
    )
    return model.train()


def tokens(j: int, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``j``: inputs and next-token targets."""
    gen = torch.Generator().manual_seed(j)
    ids = torch.randint(0, VOCAB, (rows, SEQ_LEN + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def tied(name: str) -> bool:
    model = build(name)
    return model.get_input_embeddings().weight is model.lm_head.weight


FAMILY_OF = {name: CASES[name][0]().model_type for name in CASES}
