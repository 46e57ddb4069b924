"""`python -m hf_verl ...` runs the command line."""

import sys

from hf_verl.cli import main

sys.exit(main())
