# Two commands do all the set-up:  `make demo`  and  `make test`.
# torch is installed first and pinned. PyPI's torch for Linux is the CUDA build, whose NVIDIA
# wheels weigh several GB: without an NVIDIA GPU (no working nvidia-smi) the CPU build comes from
# PyTorch's CPU wheel index instead (TORCH_INDEX; empty: PyPI and pip's own configuration only).
# TORCH and TORCH_INDEX can be set on the command line: make setup TORCH=torch==2.13.0 TORCH_INDEX=
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
NVIDIA_SMI ?= nvidia-smi
TORCH_INDEX ?= $(shell $(NVIDIA_SMI) -L >/dev/null 2>&1 || echo $(TORCH_CPU_INDEX))
PY     := $(VENV)/bin/python
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

.PHONY: setup demo test test-all lint

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e ".[test]"
	@# the checkout as a plain path entry too: a script beside a folder named compressor (the clone,
	@# seen from the folder that holds it) would otherwise import that folder as an empty namespace
	@# package, which outranks the editable install's finder; a real package on the path outranks it
	$(PY) -c "import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()['purelib'], 'compressor-checkout.pth').write_text('$(CURDIR)\n')"
	touch $@

setup: $(VENV)/.installed

demo: setup  ## prune the bundled reference Llama by 25% with SliceGPT (pca) and print before/after
	$(OFFLINE) $(VENV)/bin/compress run recipes/demo.yaml --overwrite

test: setup  ## the default suite (slow tests excluded)
	$(OFFLINE) $(PY) -m pytest -m "not slow"

test-all: setup  ## every test, the slow ones too (.ci/run), with the slowest listed and every test's time in .ci/durations.xml
	$(OFFLINE) $(PY) -m pytest --durations=15 --junitxml=.ci/durations.xml

lint: setup  ## ruff's lint rules and format (pyproject.toml), as .ci/run checks them
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
