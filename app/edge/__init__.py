"""The server's edge: the only package that imports hypercorn.

The HTTP connection (``connection.py``: the request's closer, the farewell), the fixes
to hypercorn's HTTP/1.1 (``closing_server.py``: connections that close when they should;
``request_drain.py``: a response before its request body; ``body_hot_path.py``: a body's
chunk written straight to the socket) and HTTP/2 (``h2_protocol.py``: the guarded
connection; ``h2_flow.py``: per-stream backpressure; ``h2_floods.py``: flood budgets;
``h2_retire.py``: the GOAWAY when the server drains), a blocked write told to the
request's streams (``write_blocks.py``), the refusal of a non-Trio worker
(``worker_guard.py``), the version check that installs the fixes
(``hypercorn_patches.py``), every stop signal (``signals.py``) and the ``streamscope``
command (``cli.py``). Import the modules themselves: this root exports nothing, so that
importing one of them loads no other.
"""

__all__: list[str] = []
