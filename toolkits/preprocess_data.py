"""Deprecated name of the data preprocessing: `python -m toolkits.preprocess_data ...` runs
`megatron-patch preprocess-data ...` (megatron_patch/preprocess_data.py; also
`python -m megatron_patch.preprocess_data ...`), after a note on stderr."""

import sys

from megatron_patch.preprocess_data import main as _main


def main(argv: list[str] | None = None) -> int:
    print("note: python -m toolkits.preprocess_data is deprecated; use megatron-patch preprocess-data "
          "(or python -m megatron_patch.preprocess_data)", file=sys.stderr)
    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
