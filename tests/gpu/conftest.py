"""tests/gpu/: run only where CUDA is present (bench/gpu_check.sh runs them with bench/gpu.py on a GPU machine);
skipped everywhere else, so `make test` collects them on every machine and runs them where they can run."""
import pytest
import torch


def pytest_collection_modifyitems(items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (bench/gpu_check.sh runs these on a GPU machine)")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
