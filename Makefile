# Two commands for a newcomer: `make demo` (the main job) and `make test`.
# Both create .venv first (.ci/install.sh, idempotent): the demo installs only what it runs (torch and commhooks
# with its tools), the tests everything (Horovod, MPI, DeepSpeed's ops, the frameworks, torchft, the docs).
VENV   ?= .venv
export OMP_NUM_THREADS ?= 1
NPROC  ?= 2
TRAIN  := $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) -m commhooks.tools.train
DEMO   := results/demo

.PHONY: install install-core demo test test-oldest-torch docs docs-serve gpu-check gpu-bundle bench bench-headline bench-gpt bench-gpt-headline bench-gpt-hier bench-papers clean

install:
	@bash .ci/install.sh

install-core:
	@bash .ci/install.sh core

# DDP beside the configuration to start from (a sync every 4 steps, int2 with error feedback) and the QSR rule in
# int2, on 2 CPU ranks, MNIST-1D, 1200 steps; then the table (bytes, syncs, accuracy; times on a shared 2-core
# machine are not a speed figure: commhooks bench measures those)
demo: install-core
	@start=$$(date +%s); \
	$(TRAIN) --hook none --label ddp --json-out $(DEMO)/ddp.json && \
	$(TRAIN) --config configs/start_h4_int2.json --label every-4-steps-int2 --json-out $(DEMO)/h4_int2.json && \
	$(TRAIN) --config configs/qsr_int2_mnist1d.json --label qsr-int2 --json-out $(DEMO)/qsr_int2.json && \
	$(VENV)/bin/commhooks table $(DEMO)/ddp.json $(DEMO)/h4_int2.json $(DEMO)/qsr_int2.json && \
	echo "demo: trained and compared in $$(( $$(date +%s) - start )) s"

# the whole suite on torch 2.13 (2 workers, then the `serial` tests alone), then its core on the oldest torch
# setup.cfg accepts (.ci/oldest-torch.sh says why); ends with its wall time and the 40 slowest tests (.ci/test.sh)
test: install gpu-bundle
	@bash .ci/test.sh

test-oldest-torch:
	@bash .ci/oldest-torch.sh

# the documentation site (docs/mkdocs.yml), strict: a broken link, a missing snippet or page fails it
docs: install
	$(VENV)/bin/python docs/concepts.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -f docs/mkdocs.yml

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -f docs/mkdocs.yml

# on a CUDA host: what only a GPU can show (tests/gpu; under 8 min on one H100), with no make, index or network
# there: `bash .ci/gpu-check.sh OUT`; says so and exits 0 without CUDA
gpu-check:
	@bash .ci/gpu-check.sh

# the wheels the borrowed GPU host lacks (.ci/gpu-bundle.txt), for its Python 3.12: carry .cache/gpu-bundle there
gpu-bundle:
	@bash .ci/gpu-bundle.sh

# every method at three links: a survey, one repeat each (its ratios say "1 repeat"; bench-headline resolves them)
bench: install
	$(VENV)/bin/commhooks bench --repeats 1 --out results/bench

# the README's MNIST-1D table under the protocol (docs/pages/tools/measure.md): time from 9 interleaved repeats at 100 Mbit/s,
# quality on the search's seeds 0-2 and the held-out seeds 3-5 (about 35 min here, nothing else running)
bench-headline: install
	$(VENV)/bin/commhooks bench --bandwidths 100mbit --repeats 9 --seeds 0,1,2,3,4,5 --search-seeds 0,1,2 \
		--methods ddp,compute-only,qsr-nosync,qsr-diloco-int2-a0125,qsr-sparseloco-d2-lr2,qsr-sparseloco-d2-lr2-overlap2 \
		--out results/bench-headline

# the GPT workload: 4 ranks on 2 nodes that share a 100 Mbit/s link each, 3 seeds (about 85 min here)
bench-gpt: install
	$(VENV)/bin/commhooks bench --model gpt --ranks 4 --nodes 2 --bandwidths 100mbit --seeds 0,1,2 --repeats 1 \
		--methods ddp,powersgd-r4,local-sgd-h8,qsr,qsr-constant,qsr-power1,qsr-diloco-int8-overlap,ab-groups,ab-groups-full,ab-x-qsr,compute-only \
		--out results/bench-gpt

# the README's GPT table under the protocol (docs/pages/tools/measure.md): quality on seeds 0-5 (the configurations were
# chosen on 0-2), time from 3 interleaved repeats at 100 Mbit/s; PowerSGD (50 steps of plain allreduce first) and
# QSR (its period grows as the learning rate decays) timed over the whole schedule, the others over its first 100
# steps. About 4 hours on this 2-core machine: --resume goes on from the last finished stage at the same commit
bench-gpt-headline: install
	$(VENV)/bin/commhooks bench --model gpt --ranks 4 --nodes 2 --steps 1000 --bandwidths 100mbit --repeats 3 \
		--seeds 0,1,2,3,4,5 --search-seeds 0,1,2 --time-steps 100 --whole-schedule powersgd-r4,qsr-int2-hier \
		--methods ddp,compute-only,powersgd-r4,local-h4-int2-hier,local-h2-int2-hier,qsr-int2-hier \
		--resume --out results/bench-gpt-headline

# hierarchical syncs on the GPT workload, with the references re-run beside them (README "Hierarchical syncs on the
# GPT workload"; about 50 min here)
bench-gpt-hier: install
	$(VENV)/bin/commhooks bench --model gpt --ranks 4 --nodes 2 --bandwidths 100mbit --seeds 0,1,2 --repeats 1 \
		--methods qsr-int8-hier,local-h2-int8-hier,local-h2-int8-hier-overlap,qsr,qsr-power1,powersgd-r4,ddp,compute-only \
		--out results/bench-gpt-hier

# the papers' comparisons on MNIST-1D, 3 seeds: QSR against a constant period and the power-1 rule, AB's first phase
# cut (ours) against full (the authors')
bench-papers: install
	$(VENV)/bin/commhooks bench --bandwidths unlimited --seeds 0,1,2 --repeats 1 \
		--methods ddp,qsr,qsr-constant,qsr-power1,ab-groups,ab-groups-full --out results/bench-papers

# what make and the tests generate: the demo's tables, the bench's default folder, caches (never results/<run>/,
# the recorded runs the docs cite; .venv and .cache are kept: remove them by hand to reinstall)
clean:
	rm -rf results/demo results/bench results/site .pytest_cache
	find . -name __pycache__ -type d -prune -not -path "./.venv/*" -exec rm -rf {} +
