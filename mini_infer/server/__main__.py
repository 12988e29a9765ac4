"""``python -m mini_infer.server``: the same as ``mini-infer serve`` (chapter 11)."""

import argparse

from mini_infer.server.cli import add_arguments, main

parser = argparse.ArgumentParser(prog="python -m mini_infer.server", description="an OpenAI-compatible server")
add_arguments(parser)
raise SystemExit(main(parser.parse_args()))
