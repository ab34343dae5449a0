# Two entry points on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Each creates $(VENV) if missing and installs torch first (the CPU build pinned here), then the package.
# On a host whose torch must stay (a Neuron SDK's torch with torch-neuronx, a CUDA build): point VENV at
# that environment; an installed torch-neuronx is detected and its torch kept, and SKIP_TORCH=1 keeps any
# torch already there. TORCH_SPEC=... installs another torch instead of the pinned one.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
# non-empty: keep the venv's torch (SKIP_TORCH=1, or torch-neuronx found in the venv)
KEEP_TORCH := $(if $(SKIP_TORCH),SKIP_TORCH=$(SKIP_TORCH),$(shell test -x $(PY) && $(PY) -c "import importlib.util as u; print('torch-neuronx' if u.find_spec('torch_neuronx') else '')" 2>/dev/null))

.PHONY: demo test setup clean bench

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
ifeq ($(KEEP_TORCH),)
	$(PY) -m pip install -q '$(TORCH_SPEC)'
else
	@$(PY) -c "import torch" 2>/dev/null || { echo "$(VENV) has no torch to keep ($(KEEP_TORCH)): install the torch you need there first, or drop SKIP_TORCH." >&2; exit 2; }
	@echo "keeping $(VENV)'s torch $$($(PY) -c 'import torch; print(torch.__version__)') ($(KEEP_TORCH))"
endif
	$(PY) -m pip install -q -e '.[test,plot]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
