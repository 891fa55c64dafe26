"""The benchmark commands: ``bench emulator``, ``bench runtime`` and ``bench memory``."""
