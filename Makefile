# Developer shortcuts; CI runs .ci/run, which runs the README's test command plus lint.
.PHONY: dev test lint golden bench demo

dev:            ## build and install the package in this environment
	pip install -e '.[test]'

test:           ## all tests: Rust (kernels, SIMD parity, golden) and Python
	cargo test && python -m pytest

lint:           ## formatting, clippy, ruff, mypy stubtest, pyo3 boundary (unsafe: #![deny(unsafe_code)])
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --features python -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps
	ruff check python tests benches && ruff format --check python tests benches
	python -m mypy python/ferroquant
	python -m mypy.stubtest ferroquant._ferroquant
	! grep -rlE '\bpyo3\b|numpy::' src --include='*.rs' | grep -v '^src/bindings/'

golden:         ## rewrite tests/golden/ from the Rust kernels
	cargo run --release --example write_golden
	cargo run --release --example write_golden_affine
	cargo run --release --example write_golden_dynamic
	cargo run --release --example write_golden_ptq

bench:          ## criterion + the side-by-side Python comparison
	cargo bench --bench kernels
	python benches/compare.py

demo:           ## the main job: quantize all-MiniLM-L6-v2
	ferroquant quantize --demo -o minilm-blockwise8.safetensors
