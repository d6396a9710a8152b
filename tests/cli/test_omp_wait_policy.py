"""The command line has torch's OpenMP threads wait passively unless the user says otherwise: set before torch loads
OpenMP, which reads the setting once (a value set later does nothing)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

WATCH = """
import os, sys
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not hasattr(Watch, "seen"):
            Watch.seen = os.environ.get("OMP_WAIT_POLICY")
        return None
sys.meta_path.insert(0, Watch())
import mlaconv.cli
assert "torch" in sys.modules  # the sub-commands import it: the watch saw that moment
print(Watch.seen)
"""


@pytest.mark.parametrize(("given", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_omp_wait_policy_is_set_before_torch_is_imported(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    done = subprocess.run([sys.executable, "-c", WATCH], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == expected
