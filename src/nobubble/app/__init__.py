"""The application commands: training runs and their parts, the per-rank runs, benchmarks,
experiments, demo, study and export. Thin layers over the public API (``nobubble.api``); the
command line (``nobubble.cli``) sits above them."""
