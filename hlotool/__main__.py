"""``python -m hlotool``: the same command line as ``hlotool``."""

from hlotool.cli import main

main()
