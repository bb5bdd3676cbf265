"""What users would pick instead, run beside streamscope: ``transformers serve``
(``transformers_serve.py``), the same engine behind uvicorn and Starlette
(``uvicorn_starlette.py``), and the side-by-side comparison over HTTP
(``python -m tools.peers.sidebyside``)."""
