"""``python -m tools.gpu_check OUT``: the checks that need a GPU, as one command."""
