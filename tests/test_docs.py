"""The examples in the README and the package docstring run and say what they claim."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import ferroquant as fq

README = Path(__file__).parents[1] / "README.md"


def test_readme_quickstart_runs(tmp_path, monkeypatch, capsys):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("BlockwiseQuantized(shape=(4096, 4096), scheme='blockwise8'")
    assert 0 < float(printed[1]) < 0.05
    assert (tmp_path / "weights.safetensors").exists()


def test_package_docstring_example():
    result = doctest.testmod(fq, verbose=False)
    assert result.attempted >= 1 and result.failed == 0


def test_readme_commands_are_the_ci_commands():
    # .ci/run must run exactly the README's test command.
    test_cmd = "pip install '.[test]' && cargo test && python -m pytest"
    assert test_cmd in README.read_text()
    assert test_cmd in (README.parent / ".ci" / "run").read_text()


def test_readme_ptq_example_runs(tmp_path, monkeypatch, capsys):
    section = README.read_text().split("### Post-training int8", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    # The printed repr is the one the README shows.
    shown = re.search(r"print\(qw\)\s+# (.*)", code).group(1)
    assert printed[1] == shown
    assert float(printed[0]) == fq.load(tmp_path / "model.safetensors")["model"].layers[0].scale
    assert (tmp_path / "model.json").read_bytes().startswith(b'{\n  "config_json": ')
