"""``TokenData``: train/validation token arrays and random-access micro-batches.

Split: the data is cut once into a leading train part and a trailing validation part (text at
the first line break after ``(1 - val_fraction)`` of its characters; ``.bin`` token streams at
``(1 - val_fraction)`` of their tokens, unless a directory names its own ``*val*`` shards;
documents before the last ``ceil(val_fraction * N)`` of their ``N``). The
two parts are separate arrays, so no sample window can straddle them, and the BPE tokenizer sees
the train text only.

Order: the train array is cut into ``W`` windows of ``seq_len + 1`` tokens at stride ``seq_len``
(each target token used once). Global sample ``k = m * B + i`` (micro-batch ``m``, row ``i``)
is window ``perm_e[k mod W]`` with epoch ``e = k // W`` and ``perm_e`` a permutation drawn from
``numpy.random.default_rng([seed, e])``. So micro-batch ``m`` is a pure function of
``(seed, m, B)``: it does not depend on the number of stages, the order of calls, or the
process; the data position of a checkpoint is just ``m``. ``stream_id`` names the token stream
where it is known (documents: their cache key, which changes with any file's size or mtime), so
a resume can check that it reads the same tokens.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from nobubble.data.tokenizer import Tokenizer

Batch = tuple[torch.Tensor, torch.Tensor]
Tokens = npt.NDArray[np.integer]
_MAX_CACHED_EPOCHS = 2


class TokenData:
    """Train and validation tokens plus the deterministic sample order over them."""

    def __init__(
        self,
        train_tokens: Tokens,
        val_tokens: Tokens,
        seq_len: int,
        seed: int,
        vocab_size: int,
        tokenizer: Tokenizer | None = None,
        stream_id: str | None = None,
    ) -> None:
        self.train_tokens = train_tokens
        self.val_tokens = val_tokens
        self.seq_len = seq_len
        self.seed = seed
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer  # None for pre-tokenized .bin data
        self.stream_id = stream_id
        self.num_train_windows = _num_windows(len(train_tokens), seq_len)
        self.num_val_windows = _num_windows(len(val_tokens), seq_len)
        if self.num_train_windows < 1:
            raise ValueError(
                f"the train split has {len(train_tokens)} tokens, too few for one window of "
                f"seq_len+1={seq_len + 1}; use more text or a smaller seq_len"
            )
        self._permutations: dict[int, npt.NDArray[np.int64]] = {}

    @property
    def num_train_tokens(self) -> int:
        return len(self.train_tokens)

    @property
    def num_val_tokens(self) -> int:
        return len(self.val_tokens)

    def tokens_per_microbatch(self, micro_batch_size: int) -> int:
        """Target tokens in one micro-batch (``B * seq_len``)."""
        return micro_batch_size * self.seq_len

    def train_window_ids(self, m: int, micro_batch_size: int) -> npt.NDArray[np.int64]:
        """Indices of the train windows that form micro-batch ``m``, shape (B,)."""
        _check_index("m", m, 0)
        _check_index("micro_batch_size", micro_batch_size, 1)
        k = m * micro_batch_size + np.arange(micro_batch_size, dtype=np.int64)  # (B,)
        epochs, positions = np.divmod(k, self.num_train_windows)
        ids = np.empty(micro_batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):  # a micro-batch spans at most two epochs
            rows = epochs == epoch
            ids[rows] = self._permutation(int(epoch))[positions[rows]]
        return ids

    def _permutation(self, epoch: int) -> npt.NDArray[np.int64]:
        if epoch not in self._permutations:
            if len(self._permutations) >= _MAX_CACHED_EPOCHS:
                self._permutations.pop(next(iter(self._permutations)))
            rng = np.random.default_rng([self.seed, epoch])
            self._permutations[epoch] = rng.permutation(self.num_train_windows)
        return self._permutations[epoch]

    def train_microbatch(self, m: int, micro_batch_size: int) -> Batch:
        """Micro-batch ``m`` (global, 0-based): ``(x, y)`` int64 (B, T) , y = x shifted by one."""
        return _gather(self.train_tokens, self.train_window_ids(m, micro_batch_size), self.seq_len)

    def val_batches(self, micro_batch_size: int, max_batches: int) -> list[Batch]:
        """The first ``max_batches`` full micro-batches of validation windows, in order."""
        _check_index("micro_batch_size", micro_batch_size, 1)
        _check_index("max_batches", max_batches, 1)
        n = min(max_batches, self.num_val_windows // micro_batch_size)
        if n == 0:
            raise ValueError(
                f"the validation split has {self.num_val_windows} windows of seq_len+1="
                f"{self.seq_len + 1} tokens, fewer than micro_batch_size={micro_batch_size}; "
                "raise val_fraction or lower seq_len or micro_batch_size"
            )
        ids = np.arange(n * micro_batch_size, dtype=np.int64).reshape(n, micro_batch_size)
        return [_gather(self.val_tokens, row, self.seq_len) for row in ids]

    def __repr__(self) -> str:
        return (
            f"TokenData(train={self.num_train_tokens} tokens, val={self.num_val_tokens} tokens, "
            f"vocab_size={self.vocab_size}, seq_len={self.seq_len}, seed={self.seed})"
        )


def _num_windows(num_tokens: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens at stride ``seq_len`` that fit in ``num_tokens``."""
    return max(num_tokens - 1, 0) // seq_len


def _gather(tokens: Tokens, window_ids: npt.NDArray[np.int64], seq_len: int) -> Batch:
    offsets = window_ids[:, None] * seq_len + np.arange(seq_len + 1)  # (B, T+1)
    buf = torch.from_numpy(tokens[offsets].astype(np.int64))  # (B, T+1)
    return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()  # (B, T) each


def _check_index(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
