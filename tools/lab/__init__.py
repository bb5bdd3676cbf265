"""``python -m tools.lab EXPERIMENT``: the chapter's experiments, run against our server.

Each experiment is a module here that registers itself with ``common.experiment``; see
``common.py`` for the conventions and ``__main__.py`` for the command line.
"""
