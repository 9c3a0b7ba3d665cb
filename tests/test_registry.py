"""SPEC §6: the Quantizer protocol and the registry."""

from __future__ import annotations

import numpy as np
import pytest

import ferroquant as fq
from ferroquant import registry


def test_blockwise8_is_registered_and_matches_the_function(rng):
    assert "blockwise8" in fq.list_quantizers()
    x = rng.standard_normal((50, 30)).astype(np.float32)
    quantizer = fq.get_quantizer("blockwise8", block_size=32, scale_dtype=np.float32)
    assert isinstance(quantizer, fq.Quantizer)
    assert quantizer.name == "blockwise8"
    q = quantizer.quantize(x)
    assert q == fq.quantize_blockwise(x, 32, np.float32)
    assert quantizer.dequantize(q).tobytes() == fq.dequantize_blockwise(q).tobytes()
    assert fq.get_quantizer("blockwise8").quantize(x) == fq.quantize_blockwise(x)


def test_bad_parameters_are_checked_when_the_quantizer_is_built():
    with pytest.raises(fq.InvalidConfigError, match="block_size"):
        fq.get_quantizer("blockwise8", block_size=0)
    msg = r"^quantizer 'blockwise8' takes no parameter 'bits' \(its parameters: block_size, "
    with pytest.raises(TypeError, match=msg):
        fq.get_quantizer("blockwise8", bits=4)
    with pytest.raises(TypeError, match=r"'int8' takes no parameter 'bits' \(.*: none\)"):
        fq.get_quantizer("int8", bits=4)  # not "_affine_factory.<locals>.factory()"


def test_a_factory_taking_any_keyword_gets_them_all(clean_registry):
    import functools

    fq.register_quantizer("kw", lambda **kw: Halver())
    assert isinstance(fq.get_quantizer("kw", anything=1), Halver)

    # A decorator's wrapper that takes keywords of its own: the call decides, not
    # the signature of the function it wraps.
    def debuggable(f):
        @functools.wraps(f)
        def wrapper(*a, debug=False, **k):
            return f(*a, **k)

        return wrapper

    @debuggable
    def factory(bits=8):
        return Halver()

    fq.register_quantizer("wrapped", factory)
    assert isinstance(fq.get_quantizer("wrapped", debug=True), Halver)

    # A TypeError of the factory's own, with parameters it takes, is its own.
    def picky(bits=8):
        raise TypeError("bits must be an int")

    fq.register_quantizer("picky", picky)
    with pytest.raises(TypeError, match=r"^bits must be an int$"):
        fq.get_quantizer("picky", bits="8")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(KeyError, match="blockwise8"):
        fq.get_quantizer("no-such-scheme")


class Halver:
    name = "halver"

    def quantize(self, x):
        return np.asarray(x) / 2

    def dequantize(self, q):
        return q * 2


@pytest.fixture
def clean_registry():
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def test_register_duplicate_and_replace(clean_registry):
    fq.register_quantizer("halver", Halver)
    assert fq.list_quantizers()[-1] == "halver"
    assert fq.get_quantizer("halver").quantize([4.0]) == [2.0]
    with pytest.raises(ValueError, match="already registered"):
        fq.register_quantizer("halver", Halver)
    with pytest.raises(ValueError, match="already registered"):
        fq.register_quantizer("blockwise8", Halver)
    fq.register_quantizer("blockwise8", Halver, replace=True)
    assert isinstance(fq.get_quantizer("blockwise8"), Halver)


def test_register_validates_its_arguments(clean_registry):
    with pytest.raises(TypeError):
        fq.register_quantizer("", Halver)
    with pytest.raises(TypeError):
        fq.register_quantizer("x", 42)  # type: ignore[arg-type]
    # replace is a bool, not read by truthiness: "no" must not overwrite int8.
    for bad in ("no", "False", 1, None):
        with pytest.raises(TypeError, match="replace must be a bool"):
            fq.register_quantizer("int8", Halver, replace=bad)  # type: ignore[arg-type]
    assert fq.get_quantizer("int8").name == "int8"


def test_a_factory_must_build_a_quantizer(clean_registry):
    fq.register_quantizer("notq", lambda: 42)
    with pytest.raises(TypeError, match="'notq': its factory returned a int, not a Quantizer"):
        fq.get_quantizer("notq")


def test_dynamic_names_an_unknown_scheme_with_a_typed_error():
    for bad in ("dynamic-int16", ["x"], None):
        with pytest.raises(fq.InvalidConfigError, match="name must be one of"):
            fq.Dynamic(bad)  # type: ignore[arg-type]
