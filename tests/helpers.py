"""Helpers shared by the pytest modules: subprocesses and crafted safetensors bytes."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from typing import Optional

import numpy as np


def string_array(values) -> np.ndarray:
    """Strings as NumPy 2's variable-width ``StringDType`` (a new-style dtype), or as
    fixed-width ``U`` strings on NumPy 1, which has no such dtype."""
    dtype = getattr(getattr(np, "dtypes", None), "StringDType", None)
    return np.array(values, dtype=dtype() if dtype is not None else None)


def run_python(code: str, env_extra=None, timeout=120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (anything that may hang or crash)."""
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def cli(*args: str, env_extra=None) -> subprocess.CompletedProcess:
    """Run ``ferroquant ARGS`` in a subprocess."""
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "ferroquant", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def craft(header: dict, data: bytes = b"", header_len: Optional[int] = None) -> bytes:
    """safetensors bytes with this JSON header (padded to 8) and data."""
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    n = len(text) if header_len is None else header_len
    return struct.pack("<Q", n) + text + data
