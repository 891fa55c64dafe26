from pathlib import Path

import pytest
import torch

from nobubble.data import fetch_shakespeare

# Tiny test models run fastest on one intra-op thread, and one thread per test process keeps
# OpenMP from spinning against other processes on this 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A 200 kB slice of the default corpus as a file (real text; BPE trains on it in well under
    1 s). A module may define its own ``corpus`` (test_data.py: the whole text)."""
    path = tmp_path_factory.mktemp("corpus") / "plays.txt"
    path.write_text(fetch_shakespeare().read_text()[:200_000])
    return path
