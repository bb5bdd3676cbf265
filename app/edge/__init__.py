"""The server's edge: the only package that imports hypercorn.

The HTTP connection (``connection.py``: the request's closer, the farewell), the fixes
to hypercorn's HTTP/1.1 (``http_fixes.py``), the refusal of a non-Trio worker
(``worker_guard.py``), every stop signal (``signals.py``) and the ``streamscope``
command (``cli.py``). Import the modules themselves: this root exports nothing, so that
importing one of them loads no other.
"""

__all__: list[str] = []
