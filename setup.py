"""Builds the native CPU kernel library (`cpu_kernels/`) at install time; everything else is in pyproject.toml.

The library is a plain shared object loaded with ctypes and registered as an XLA FFI target, not a Python
module. It compiles against the XLA FFI headers that jaxlib ships (`jax.ffi.include_dir()`); jaxlib is a
build requirement for that reason. No `-march`: the AVX-512 and AVX2 paths carry their own target
attributes and are chosen at run time.
"""

import os

import jaxlib
from setuptools import Extension, setup

_FFI_INCLUDE = os.path.join(os.path.dirname(jaxlib.__file__), "include")

setup(ext_modules=[Extension(
    "cpu_kernels._native",
    sources=["cpu_kernels/skinny_matmul.cc", "cpu_kernels/paged_attention.cc", "cpu_kernels/amx_matmul.cc",
             "cpu_kernels/log_softmax.cc", "cpu_kernels/sampling.cc"],
    include_dirs=[_FFI_INCLUDE],
    language="c++",
    # -fno-trapping-math lets GCC vectorize loops with float comparisons (sampling.cc); no value changes.
    extra_compile_args=["-O3", "-std=c++17", "-w", "-fno-trapping-math"],
)])
