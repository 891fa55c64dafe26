"""nobubble: pipeline-parallel LM pretraining with synchronous and asynchronous schedules.

Layer 0 (no torch): ``ir``, ``deps``, ``placement``, ``schedules``, ``ledger``, ``validate``,
``sim``, ``viz``.
Layer 1 (torch): ``model``, ``data``, ``optim``, ``exec``. Layer 2: ``dist``. Layer 3: ``config``,
``train``, ``cli``. Importing the package imports nothing heavy.
"""

__version__ = "0.1.0"
