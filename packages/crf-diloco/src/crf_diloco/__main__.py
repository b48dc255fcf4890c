"""``python -m crf_diloco launch ...`` — same as the ``crf-diloco`` command."""

import sys

from crf_diloco.cli import main

if __name__ == "__main__":
    sys.exit(main())
