# Two commands for a newcomer: `make demo` (the main job) and `make test`.
# Both create .venv and install everything first (.ci/install.sh, idempotent).
VENV   ?= .venv
export OMP_NUM_THREADS ?= 1
NPROC  ?= 2
TRAIN  := $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) -m commhooks.tools.train
DEMO   := results/demo

.PHONY: install demo test docs docs-serve gpu-check gpu-wheels bench bench-gpt bench-gpt-hier bench-papers clean

install:
	@bash .ci/install.sh

# DDP beside the project's best methods on 2 CPU ranks (about a minute): QSR with a DiLoCo outer step, int8
# payload and overlapped syncs; AB x QSR with int8 world syncs; plain QSR
demo: install
	$(TRAIN) --hook none --label ddp-allreduce --json-out $(DEMO)/ddp.json
	$(TRAIN) --config configs/qsr_diloco_int8_overlap_mnist1d.json --label qsr-outer-int8-overlap --json-out $(DEMO)/qsr_best.json
	$(TRAIN) --config configs/abqsr_int8_mnist1d.json --label ab-x-qsr-int8 --json-out $(DEMO)/abqsr.json
	$(TRAIN) --config configs/qsr_mnist1d.json --label qsr --json-out $(DEMO)/qsr.json
	@$(VENV)/bin/commhooks table $(DEMO)/ddp.json $(DEMO)/qsr_best.json $(DEMO)/abqsr.json $(DEMO)/qsr.json

test: install
	$(VENV)/bin/python -m pytest -q

# the documentation site (docs/mkdocs.yml), strict: a broken link, a missing snippet or page fails it
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -f docs/mkdocs.yml

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -f docs/mkdocs.yml

# on a CUDA host: what only a GPU can show (tests/gpu; about 5 min on one H200); skipped, saying so, without CUDA
gpu-check:
	@bash .ci/gpu-check.sh

# wheels a GPU host without a package index lacks (its own python 3.12 and torch): carry .cache/gpu-wheels there
gpu-wheels: install
	$(VENV)/bin/python -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 -d .cache/gpu-wheels pydantic python-hostlist pytest-timeout
	$(VENV)/bin/python -m pip wheel -q --no-deps -w .cache/gpu-wheels deepspeed==$$($(VENV)/bin/python -c \
		"import deepspeed; print(deepspeed.__version__)") hjson ninja py-cpuinfo msgpack nvidia-ml-py

bench: install
	$(VENV)/bin/commhooks bench --out results/bench

# the GPT workload: 4 ranks on 2 nodes that share a 100 Mbit/s link each, 3 seeds (about 85 min here)
bench-gpt: install
	$(VENV)/bin/commhooks bench --model gpt --ranks 4 --nodes 2 --bandwidths 100mbit --seeds 0,1,2 \
		--methods ddp,powersgd-r4,local-sgd-h8,qsr,qsr-constant,qsr-power1,qsr-diloco-int8-overlap,ab-groups,ab-groups-full,ab-x-qsr,compute-only \
		--out results/bench-gpt

# hierarchical syncs on the GPT workload, with the references re-run beside them (README "Hierarchical syncs on the
# GPT workload"; about 50 min here)
bench-gpt-hier: install
	$(VENV)/bin/commhooks bench --model gpt --ranks 4 --nodes 2 --bandwidths 100mbit --seeds 0,1,2 \
		--methods qsr-int8-hier,local-h2-int8-hier,local-h2-int8-hier-overlap,qsr,qsr-power1,powersgd-r4,ddp,compute-only \
		--out results/bench-gpt-hier

# the papers' comparisons on MNIST-1D, 3 seeds: QSR against a constant period and the power-1 rule, AB's first phase
# cut (ours) against full (the authors')
bench-papers: install
	$(VENV)/bin/commhooks bench --bandwidths unlimited --seeds 0,1,2 \
		--methods ddp,qsr,qsr-constant,qsr-power1,ab-groups,ab-groups-full --out results/bench-papers

clean:
	rm -rf results .pytest_cache
