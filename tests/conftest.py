"""Frees each test module's compiled programs when it ends; one persistent compilation cache for the session;
the instruction-set default kernels.

The suite runs in two pytest-xdist workers, a test file to each (`--dist loadfile`, `pyproject.toml`): on
a 2-core machine much of a test is one busy core (compiling, scheduling on the host), so two workers took
the suite from 54-59 minutes to 37-41 on the development VM.

Every XLA:CPU executable holds dozens of memory mappings; the whole suite keeps
thousands of programs, which exceeded the kernel's limit (`vm.max_map_count`,
65530) and crashed XLA mid-suite (abort or segfault in compilation). A program
that a later module (or a subprocess: the command-line, tensor-parallel and
distributed tests) needs again then loads from the session's compilation cache
instead of compiling (a real-model step program compiles in seconds).
"""

import atexit
import gc
import os
import shutil
import tempfile

import jax

# Engines take the instruction-set default kernels, as before kernel timing (`engine.kernels`): a suite's
# exact-token assertions must not depend on which kernel a noisy machine timed faster. `test_kernels.py`
# turns timing back on.
os.environ["JSE_MEASURE_KERNELS"] = "0"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # a pytest-xdist worker: the controller's cache, so a program one worker compiled loads in the other
    _CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"]
else:
    _CACHE = tempfile.mkdtemp(prefix="jax-compilation-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE  # inherited by the workers and the tests' subprocesses
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
import pytest

from engine.compilation import release_all
from engine.spec.draft import make_spec_step
from engine.step import make_step


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    make_step.cache_clear()
    make_spec_step.cache_clear()
    release_all()
    gc.collect()

