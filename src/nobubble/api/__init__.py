"""The public Python API: ``Pipeline`` and its parts, ``split``, ``materialize``, weights a
stage at a time. The front door ``nobubble`` names it lazily."""
