"""Layer 0, the torch-free core: schedules as data and everything derived from them.

``ir`` (actions and schedules), ``deps`` (the dependency rule), ``placement``, ``comm``
(per-rank communication plans and their NCCL check), ``schedules`` (the generators), ``ledger``
(weight versions), ``validate``, ``sim`` (the simulator), ``viz`` (traces and Gantt charts),
``util`` and ``errors``. Nothing here imports torch.
"""
