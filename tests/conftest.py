"""Frees each test module's compiled programs when it ends.

Every XLA:CPU executable holds dozens of memory mappings; the whole suite keeps
thousands of programs, which exceeded the kernel's limit (`vm.max_map_count`,
65530) and crashed XLA mid-suite (abort or segfault in compilation).
"""

import gc

import jax
import pytest

from engine.speculative import make_spec_step
from engine.step import make_step


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    make_step.cache_clear()
    make_spec_step.cache_clear()
    jax.clear_caches()
    gc.collect()

