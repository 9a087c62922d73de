"""Loading, saving and converting checkpoints: GGUF, Hugging Face safetensors, Orbax."""

from checkpoints.gguf_loader import load_gguf
from checkpoints.hf import load_hf_dir, save_hf_dir
from checkpoints.orbax_io import load_orbax, save_orbax
from checkpoints.resolve import DEFAULT_MODEL, LoadedModel, default_gguf_path, load_model
from checkpoints.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MODEL", "LoadedModel", "Tokenizer", "default_gguf_path", "load_gguf", "load_hf_dir",
    "load_model", "load_orbax", "save_hf_dir", "save_orbax",
]
