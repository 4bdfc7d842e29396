"""Deprecated name of the converter: `python -m toolkits.checkpoint_converter ...` runs `megatron-patch convert ...`
(megatron_patch/convert.py; also `python -m megatron_patch.convert ...`), after a note on stderr."""

import sys

from megatron_patch.convert import main as _main


def main(argv: list[str] | None = None) -> int:
    print("note: python -m toolkits.checkpoint_converter is deprecated; use megatron-patch convert "
          "(or python -m megatron_patch.convert)", file=sys.stderr)
    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
