"""Converts any loadable model into an Orbax or Hugging Face safetensors directory.

  python -m checkpoints.convert --src=smollm2-135m-instruct --dst=/tmp/smollm2 --format=orbax
"""

from __future__ import annotations

from absl import app, flags, logging

from checkpoints.hf import save_hf_dir
from checkpoints.orbax_io import save_orbax
from checkpoints.resolve import DEFAULT_MODEL, load_model

_SRC = flags.DEFINE_string("src", DEFAULT_MODEL, "Model name or path, as accepted by load_model.")
_DST = flags.DEFINE_string("dst", None, "Output directory.", required=True)
_FORMAT = flags.DEFINE_enum("format", "orbax", ["orbax", "safetensors"], "Output format.")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Weight dtype (default: the source's).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    model = load_model(_SRC.value, _DTYPE.value)
    if _FORMAT.value == "orbax":
        save_orbax(_DST.value, model.config, model.params, tokenizer=model.tokenizer)
    else:
        save_hf_dir(_DST.value, model.config, model.params, tokenizer=model.tokenizer)
    logging.info("wrote %s (%s, %s, %.1fM params) to %s", model.config.name, _FORMAT.value,
                 model.config.dtype, model.config.num_params / 1e6, _DST.value)


if __name__ == "__main__":
    app.run(main)
