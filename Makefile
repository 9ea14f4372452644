# Two commands for a newcomer: `make demo` (the main job) and `make test`.
# Both create .venv and install everything first (.ci/install.sh, idempotent).
VENV   ?= .venv
export OMP_NUM_THREADS ?= 1
NPROC  ?= 2
TRAIN  := $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) -m commhooks.tools.train
DEMO   := results/demo

.PHONY: install demo test bench bench-gpt clean

install:
	@bash .ci/install.sh

demo: install
	$(TRAIN) --hook none --label ddp-allreduce --json-out $(DEMO)/ddp.json
	$(TRAIN) --hook qsr --config configs/qsr_mnist1d.json --label qsr --json-out $(DEMO)/qsr.json
	$(TRAIN) --hook ab --config configs/ab_mnist1d.json --label ab-groups --json-out $(DEMO)/ab.json
	$(TRAIN) --hook ab --config configs/ab_onlyb_mnist1d.json --label ab-only-b --json-out $(DEMO)/ab_onlyb.json
	@$(VENV)/bin/commhooks table $(DEMO)/ddp.json $(DEMO)/qsr.json $(DEMO)/ab.json $(DEMO)/ab_onlyb.json

test: install
	$(VENV)/bin/python -m pytest -q

bench: install
	$(VENV)/bin/commhooks bench --out results/bench

# the GPT workload: 4 ranks on 2 nodes that share a 100 Mbit/s link each (about an hour here)
bench-gpt: install
	$(VENV)/bin/commhooks bench --model gpt --ranks 4 --nodes 2 --bandwidths 100mbit,unlimited \
		--methods ddp,powersgd-r4,local-sgd-h8,qsr,ab-groups,ab-x-qsr,compute-only --out results/bench-gpt

clean:
	rm -rf results .pytest_cache
