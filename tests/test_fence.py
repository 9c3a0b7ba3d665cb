"""No kernel reads a byte outside its input arrays, on any instruction-set tier.

``fence.py`` runs the public API with every array the native module reads placed
against a page that faults on access (see its docstring); here it runs once a tier.
"""

from __future__ import annotations

import os
import sys

import pytest
from helpers import run_python

import ferroquant as fq

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="mprotect through ctypes and SIGSEGV, as on Linux"
)

DRIVER = os.path.join(os.path.dirname(__file__), "fence.py")


def _driver(isa: str):
    return run_python(
        f"import runpy; runpy.run_path({DRIVER!r}, run_name='__main__')",
        env_extra={"FERROQUANT_SIMD": isa, "FERROQUANT_NUM_THREADS": "2"},
        timeout=600,
    )


def test_the_fence_faults_one_byte_past_either_end():
    """The driver's arrays really are fenced: a read just outside one kills the process."""
    for at_end, offset in ((True, "a.nbytes"), (False, "-1")):
        proc = run_python(
            f"""
            import ctypes, runpy, numpy as np
            fence = runpy.run_path({DRIVER!r})
            a = fence["fenced"](np.arange(5, dtype=np.float32), {at_end})
            assert a.tolist() == [0, 1, 2, 3, 4] and a.flags.writeable
            last = ctypes.c_uint8.from_address(a.ctypes.data + a.nbytes - 1).value
            print("inside", last, flush=True)
            ctypes.c_uint8.from_address(a.ctypes.data + {offset}).value
            print("outside read", flush=True)
            """
        )
        assert "inside 64" in proc.stdout
        assert "outside read" not in proc.stdout
        assert proc.returncode == -11, (proc.returncode, proc.stderr[-2000:])


@pytest.mark.parametrize("isa", fq.supported_isas())
def test_no_kernel_reads_outside_its_inputs(isa):
    proc = _driver(isa)
    last_call = proc.stderr.strip().splitlines()[-1:] if proc.stderr else []
    assert proc.returncode == 0, (proc.returncode, last_call, proc.stderr[-3000:])
    assert proc.stdout.strip().endswith(f"calls on {isa}"), proc.stdout
