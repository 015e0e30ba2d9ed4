import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)  # harness
sys.path.insert(0, os.path.join(here, "..", "tests"))  # helpers

import importlib.util as _ilu  # noqa: E402

_spec = _ilu.spec_from_file_location("_scaledmm_tests_conftest", os.path.join(here, "..", "tests", "conftest.py"))
_tests_conftest = _ilu.module_from_spec(_spec)
_spec.loader.exec_module(_tests_conftest)
pytest_collection_modifyitems = _tests_conftest.pytest_collection_modifyitems
pytest_runtest_makereport = _tests_conftest.pytest_runtest_makereport
_seed = _tests_conftest._seed
