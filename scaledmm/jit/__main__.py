"""``python -m scaledmm.jit {status, build ...}``: see :mod:`scaledmm.jit.cli`."""

import sys

from scaledmm.jit.cli import main

sys.exit(main())
