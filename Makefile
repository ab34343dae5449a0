# Two entry points on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Each creates $(VENV) if missing and installs torch first (the pinned torch==2.13.0 from PyPI: on Linux x86_64
# PyPI's wheel of it is a CUDA build, elsewhere a CPU one), then the package.
# On a host whose torch must stay (a Neuron SDK's torch with torch-neuronx, a CUDA build): point VENV at
# that environment; an installed torch-neuronx is detected and its torch kept, and SKIP_TORCH=1 keeps any
# torch already there. TORCH_SPEC=... installs another torch instead of the pinned one; its words are passed
# to pip one by one, so it may carry pip options:
#   make demo TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
# and TORCH_INDEX_URL=URL is the same index given apart (TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu: the CPU build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
# each word of TORCH_SPEC quoted on its own (a `>=` stays a version, not a shell redirection)
TORCH_ARGS := $(foreach w,$(TORCH_SPEC),'$(w)')$(if $(TORCH_INDEX_URL), --index-url '$(TORCH_INDEX_URL)')
# non-empty: keep the venv's torch (SKIP_TORCH=1, or torch-neuronx found in the venv)
KEEP_TORCH := $(if $(SKIP_TORCH),SKIP_TORCH=$(SKIP_TORCH),$(shell test -x $(PY) && $(PY) -c "import importlib.util as u; print('torch-neuronx' if u.find_spec('torch_neuronx') else '')" 2>/dev/null))

# The XLA suite (tests/xla) runs in an environment of its own: torch_xla pins its torch (2.9, a CUDA build on
# PyPI, about 7 GB), which must not replace the main one. It lives outside the clone, named by the hash of
# requirements/xla.txt, so a fresh clone on the same machine (CI) reuses it; XLA_VENV=... points elsewhere,
# SKIP_XLA=1 leaves the XLA suite out of `make test`.
XLA_REQUIREMENTS := requirements/xla.txt
XLA_HASH := $(shell sha256sum $(XLA_REQUIREMENTS) 2>/dev/null | cut -c1-12)
XLA_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/staticformers/venv-xla-$(XLA_HASH)
XLA_PY := $(XLA_VENV)/bin/python
XLA_STAMP := $(XLA_VENV)/.installed

.PHONY: demo test test-xla setup setup-xla clean bench

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
ifeq ($(KEEP_TORCH),)
	$(PY) -m pip install -q $(TORCH_ARGS)
else
	@$(PY) -c "import torch" 2>/dev/null || { echo "$(VENV) has no torch to keep ($(KEEP_TORCH)): install the torch you need there first, or drop SKIP_TORCH." >&2; exit 2; }
	@echo "keeping $(VENV)'s torch $$($(PY) -c 'import torch; print(torch.__version__)') ($(KEEP_TORCH))"
endif
	$(PY) -m pip install -q -e '.[test,plot]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Both suites run whatever the other's result; the target fails if either failed, and says which. The XLA suite
# runs beside the main one (its output held in a file and printed after the main suite's): it keeps about one
# core busy, and after the main suite it left the other idle for its whole run.
test: $(STAMP)
	@t0=$$(date +%s); xla=skipped; xla_log=$$(mktemp); xla_pid=; \
	if [ -z "$(SKIP_XLA)" ]; then $(MAKE) -s test-xla > "$$xla_log" 2>&1 & xla_pid=$$!; fi; \
	main=0; $(PY) -m pytest -q -n 2 --dist loadfile tests || main=$$?; t1=$$(date +%s); \
	if [ -n "$$xla_pid" ]; then xla=0; wait $$xla_pid || xla=$$?; \
	echo "--- XLA suite (tests/xla), run beside the main suite:"; cat "$$xla_log"; fi; t2=$$(date +%s); \
	rm -f "$$xla_log"; \
	echo "make test: main suite exit $$main in $$((t1 - t0)) s, XLA suite exit $$xla, all done in $$((t2 - t0)) s"; \
	[ "$$main" = 0 ] && { [ "$$xla" = 0 ] || [ "$$xla" = skipped ]; }

# no prerequisite on the requirements file: its hash names the folder, and a fresh clone's newer file
# must not reinstall 7 GB
$(XLA_STAMP):
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_PY) -m pip install -q --upgrade pip
	$(XLA_PY) -m pip install -q -r $(XLA_REQUIREMENTS)
	touch $(XLA_STAMP)

setup-xla: $(XLA_STAMP)

# the package from this checkout (PYTHONPATH), on XLA's CPU device
test-xla: $(XLA_STAMP)
	PJRT_DEVICE=CPU PYTHONPATH=$(CURDIR)/src $(XLA_PY) -m pytest -q tests/xla

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
