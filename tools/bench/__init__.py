"""The engine's micro-benchmarks, one runner: ``python -m tools.bench NAME [options]``.

Each measures the engine alone, in this process, with no server (``tools.lab`` measures
the service over HTTP); ``__main__.py`` says what every bench takes and writes.
"""
