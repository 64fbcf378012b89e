"""python3 -m megacpp_checkpoint OFFICIAL_DIR OUT_DIR: import_official from the command line."""
import sys

from megacpp_checkpoint import _main

sys.exit(_main(sys.argv[1:]))
