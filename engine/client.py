"""Deprecated name of `engine.query`, the gRPC command-line client (`engine.client` read like the client
library, `engine.serving.client`); it goes in the next release."""

import sys

from engine.query import run

if __name__ == "__main__":
    print("python -m engine.client is deprecated: use python -m engine.query", file=sys.stderr)
    run()
