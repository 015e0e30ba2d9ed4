import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)  # harness
sys.path.insert(0, os.path.join(here, "..", "tests"))  # helpers
