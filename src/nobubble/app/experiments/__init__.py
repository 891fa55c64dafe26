"""The experiments of ``nobubble experiment NAME``: the two papers' claims at small scale.

``experiment`` runs one (its grids, summary and table), ``runner`` the resumable run grids,
``keys`` the run keys, ``grids`` each experiment's runs, the ``*analysis`` modules their
summaries, ``stats`` the intervals and verdicts, ``report`` docs/results.md. A plain package:
import from the submodules."""
