# fabric-lib front door. `make run` and `make test` each set up what they need.
#
#   make deps    install the Debian packages the build needs (idempotent, quiet when present)
#   make build   configure and build; binaries land in build/bin/
#   make run     loopback demonstration: two processes, verified writes, throughput per op
#   make test    everything CI runs, stage by stage (TEST_STAGES), printing each stage's time:
#                format check, the default build and its tests (unit, conformance, reliability,
#                kv, netlab, the verbs backend on Soft-RoCE in a qemu guest: ctest -L rxe, the
#                installed copy: -L consumer, the docs: -L docs), Python tests, the fuzz
#                targets, ASan+UBSan and TSan (each building only what SANITIZER_LABELS need)
#   make test-python  the fabric_lib Python module's pytest suite (Debian's /usr/bin/python3)
#   make bench   the full benchmark over tcp and shm, with its baselines (UCX, iperf3, raw
#                libfabric): tables on stdout, bench/results/<provider>.{json,md,png};
#                BENCH_ARGS="--mode progress" for caller-driven groups (fabric-bench --help)
#   make bench-peers  fabric-lib beside its peers (bench/peers, docs/benchmark.md): fabric-bench,
#                raw libfabric, nixlbench FABRIC (where tools/nixl/build_nixl.sh built it), NIXL's
#                wheel with FABRIC and UCX, Mooncake's Transfer Engine; TCP loopback and same-host;
#                makes .venv when missing; build/bench-peers/peers.{json,md,png};
#                PEERS_OUT, PEERS_ARGS: peers.py's options
#   make bench-netlab  multi-NIC aggregation on the network-namespace lab (root): N = 1, 2, 4
#                shaped veth links and an unequal set; bench/results/netlab.{md,json}
#   make test-fuzz  build the libFuzzer targets (tests/fuzz, clang) and run each for
#                FUZZ_SECONDS (15); fails on any crash, leak or sanitizer report
#   make fuzz-long  the same for FUZZ_LONG_SECONDS (600) per target; prints exec counts
#   make soak    the long soak with accounting (docs/hardening.md): >= 10^6 transfers
#   make demo-kv the disaggregated KV-cache demonstration (examples/disagg_kv): a router,
#                prefill and decode processes and a private etcd on this machine; a table
#   make docs-api  the API reference from the public headers (Doxygen): build/docs-api/html
#   make e2e-vllm  vLLM's disaggregated prefill/decode over NIXL on this machine's CPUs, end to
#                end (docs/nixl.md): .venv from PyPI (pinned), a tiny model made here, the FABRIC
#                plugin for the wheel's NIXL (where NIXL's headers were fetched by hand; else the
#                FABRIC runs are skipped, saying why), NixlConnector over FABRIC and UCX against a
#                single server, the fault cases; build/e2e/vllm.json. E2E_ARGS: run_e2e.py's
#   make install PREFIX=DIR  cmake --install of the default build (headers, libraries, the CMake
#                package fabric, fabric.pc)
#   make format  apply .clang-format to every source file

SHELL := /bin/bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c

DEB_PACKAGES := cmake ninja-build g++ pkg-config make \
  libfabric-dev libfabric-bin libhwloc-dev hwloc libfmt-dev libspdlog-dev libcli11-dev \
  libgtest-dev googletest clang-format iproute2 libibverbs-dev ibverbs-providers rdma-core \
  pybind11-dev python3-dev python3-pip python3-pytest python3-pytest-timeout python3-numpy \
  python3-torch etcd-server libcurl4-openssl-dev nlohmann-json3-dev python3-prometheus-client \
  libssl-dev doxygen python3-venv
# Only `make bench` installs these: the baselines fabric-bench compares with (ucx_perftest,
# iperf3, run in a private network namespace made with unshare and ip) and the plot.
BENCH_PACKAGES := ucx-utils iperf3 python3-matplotlib iproute2 util-linux
# Only the fuzz targets (make test-fuzz, fuzz-long) need these: clang and its libFuzzer runtime.
FUZZ_PACKAGES := clang libclang-rt-14-dev
FUZZ_SECONDS ?= 15
FUZZ_LONG_SECONDS ?= 600
# make soak: transfers per provider (at most 2097151) and a time bound per provider.
SOAK_PROVIDERS ?= tcp
SOAK_TRANSFERS ?= 1000000
SOAK_SECONDS ?= 3600
BENCH_PROVIDERS ?= tcp shm
BENCH_ARGS ?=
SOURCES = $(shell git ls-files '*.h' '*.cc' '*.cpp' '*.hpp' '*.cu' '*.cuh' 2>/dev/null)
# Tests run CTEST_JOBS at a time: most of their time is spent waiting (on peers, timeouts,
# links), not computing. Tests whose bounds are about time are RUN_SERIAL (netlab).
CTEST_JOBS ?= 2
CTEST_ARGS ?= --output-on-failure --timeout 600 -j $(CTEST_JOBS)
# The Python tests run on Debian's interpreter (a python3 earlier on PATH may see no Debian
# packages), against the package as built in build/python.
PYTHON := /usr/bin/python3
PYTEST_ARGS ?= -q -rs

# make test's stages, in order; each one's time is printed, and all of them at the end. The
# sanitizer builds (BACKGROUND_STAGES) start in the background, at the lowest CPU priority, once
# the default build is done: the default build's tests leave about 40 % of the CPU idle (they
# wait on peers, timeouts and links), and the builds take it. `sanitizer-builds` waits for them
# (its time is what was left to build) before their tests run; their log is
# build/sanitizer-builds.log.
TEST_STAGES := deps check-format build test-default test-python fuzz-build test-fuzz \
  sanitizer-builds test-asan test-tsan e2e-vllm
BACKGROUND_STAGES := build-asan build-tsan
# The sanitizer builds run these labels and build only their tests' targets (gpu and verbs need
# hardware CI lacks, and sanitizer builds have no CUDA; they run in the default build). TSan
# leaves out netlab: its multi-NIC failover logic runs on the worker thread alone, the same
# threads as conformance's multi-NIC tests, and its shaped links make it the slowest label by far.
SANITIZER_LABELS := ^(unit|conformance|reliability|kv|netlab)$$
TSAN_LABELS := ^(unit|conformance|reliability|kv)$$
# The unit programs are one per feature folder (tests/engine, tests/shm, ...; docs/testing.md).
UNIT_TARGETS := fabric_engine_tests fabric_shm_unit_tests fabric_cuda_ipc_tests \
  fabric_common_tests fabric_discovery_tests fabric_verbs_unit_tests fabric_weights_unit_tests \
  fabric_ep_tests
SANITIZER_TARGETS := $(UNIT_TARGETS) fabric_conformance_tests fabric_test_peer \
  fabric_reliability_tests fabric_bad_input_tests fabric_soak fabric_kv_tests \
  fabric_kv_test_peer fabric_netlab_tests fabric_shm_tests
PREFIX ?= /usr/local

.PHONY: e2e-vllm
.PHONY: deps build run test test-default test-python test-asan test-tsan build-asan build-tsan \
  bench bench-peers bench-deps format check-format clean bench-netlab test-fuzz fuzz-long \
  fuzz-build soak demo-kv docs-api install

deps:
	@missing=()
	for p in $(DEB_PACKAGES); do
	  dpkg-query -W -f='$${Status}' "$$p" 2>/dev/null | grep -q "ok installed" || missing+=("$$p")
	done
	if [ $${#missing[@]} -gt 0 ]; then
	  echo "installing: $${missing[*]}"
	  SUDO=$$( [ "$$(id -u)" = 0 ] && echo "" || echo sudo )
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$${missing[@]}" >/dev/null
	fi

build: deps
	@cmake --preset default >/dev/null
	cmake --build --preset default

# The demonstration's mode fits the machine (RUN_MODE=worker|progress|callbacks overrides): with
# 4 cores or fewer, a worker thread per engine plus the peers and the baseline outnumber the
# cores and every completion waits for the scheduler, so the calling thread drives instead.
RUN_MODE ?= $(shell [ "$$(nproc)" -le 4 ] && echo progress || echo worker)

run: build
	@./build/bin/fabric-info --provider tcp --nic lo
	echo
	if [ "$(RUN_MODE)" = progress ]; then
	  echo "$$(nproc) cores: caller-driven progress (--mode progress), the mode for a machine this size:"
	  echo "the submitting thread drives the engine, so no completion waits for a thread wake-up."
	else
	  echo "$$(nproc) cores: --mode $(RUN_MODE), a worker thread per engine (RUN_MODE=progress: the caller drives)."
	fi
	echo "Each row: ours beside bare libfabric (raw) in the same run. ours/raw of a rate (Gbps, Mops)"
	echo "above 1 is faster; of a round-trip time (p50) above 1 is slower. Every pass is verified."
	echo
	echo "== loopback demonstration over libfabric tcp =="
	./build/bin/fabric-bench --provider tcp --nic lo --quick --mode $(RUN_MODE)
	echo
	echo "== loopback demonstration over the engine's shm transport =="
	./build/bin/fabric-bench --provider shm --nic shm --quick --mode $(RUN_MODE)

test:
	@times=()
	report() {
	  echo "== stage times (s, wall clock) =="
	  for t in "$${times[@]}"; do echo "  $$t"; done
	}
	# The background builds run in a session of their own, killed if make test stops early.
	bg=
	trap '[ -z "$$bg" ] || kill -- -"$$bg" 2>/dev/null || true' EXIT
	all_start=$$(date +%s)
	for stage in $(TEST_STAGES); do
	  if [ "$$stage" = test-default ] && [ -n "$(BACKGROUND_STAGES)" ]; then
	    mkdir -p build
	    echo "== starting in the background (nice 19): $(BACKGROUND_STAGES); log build/sanitizer-builds.log"
	    setsid nice -n 19 bash -c 'for b in $(BACKGROUND_STAGES); do s=$$(date +%s); \
	      $(MAKE) --no-print-directory $$b || exit 1; echo "== $$b: $$(( $$(date +%s) - s )) s"; done' \
	      >build/sanitizer-builds.log 2>&1 </dev/null &
	    bg=$$!
	  fi
	  echo "== stage $$stage =="
	  start=$$(date +%s)
	  if [ "$$stage" = sanitizer-builds ]; then
	    bg_rc=0
	    [ -z "$$bg" ] || wait "$$bg" || bg_rc=$$?
	    bg=
	    grep -E '^== build-' build/sanitizer-builds.log || true
	    if [ "$$bg_rc" != 0 ]; then
	      tail -n 60 build/sanitizer-builds.log
	      times+=("$$(printf '%-13s %6d  FAILED' $$stage $$(( $$(date +%s) - start )))")
	      report
	      exit 1
	    fi
	    times+=("$$(printf '%-13s %6d  (the rest of $(BACKGROUND_STAGES))' $$stage $$(( $$(date +%s) - start )))")
	    continue
	  fi
	  if ! $(MAKE) --no-print-directory $$stage; then
	    times+=("$$(printf '%-13s %6d  FAILED' $$stage $$(( $$(date +%s) - start )))")
	    report
	    exit 1
	  fi
	  times+=("$$(printf '%-13s %6d' $$stage $$(( $$(date +%s) - start )))")
	  echo "== stage $$stage: $$(( $$(date +%s) - start )) s"
	done
	times+=("$$(printf '%-13s %6d' total $$(( $$(date +%s) - all_start )))")
	report
	echo "all test suites passed"

test-default: build
	@ctest --preset default $(CTEST_ARGS)

test-python: build
	@if ! ls build/python/fabric_lib/_fabric_lib*.so >/dev/null 2>&1; then
	  echo "the fabric_lib Python module was not built: FABRIC_BUILD_PYTHON is off in build/ (are pybind11-dev and python3-dev installed? run: make deps, then cmake --preset default -DFABRIC_BUILD_PYTHON=ON)"
	  exit 1
	fi
	PYTHONPATH=$(CURDIR)/build/python $(PYTHON) -m pytest $(PYTEST_ARGS) tests/python

build-asan: deps
	@cmake --preset asan >/dev/null
	cmake --build --preset asan --target $(SANITIZER_TARGETS)

test-asan: build-asan
	@ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --preset asan -L '$(SANITIZER_LABELS)' $(CTEST_ARGS)

build-tsan: deps
	@cmake --preset tsan >/dev/null
	cmake --build --preset tsan --target $(SANITIZER_TARGETS)

# Under TSan, libfabric tcp's fi_enable spends seconds in one memset: the receive pool of
# ofi_rxm (1024 buffers of 16 KiB), each byte's shadow updated by TSan's interceptor. Smaller
# bounce buffers and fewer of them cut a tcp engine's creation there from ~7 s to ~2 s (the
# ASan run keeps the provider's defaults).
TSAN_FI_ENV := FI_OFI_RXM_BUFFER_SIZE=4096 FI_OFI_RXM_MSG_RX_SIZE=32
test-tsan: build-tsan
	@TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$(CURDIR)/tests/tsan.supp" \
	  $(TSAN_FI_ENV) ctest --preset tsan -L '$(TSAN_LABELS)' $(CTEST_ARGS)

docs-api: deps
	@mkdir -p build
	tests/docs/run_doxygen.sh $(CURDIR) $(CURDIR)/build/docs-api

install: build
	@cmake --install build --prefix $(PREFIX)

# The fuzz build configures only when clang with libFuzzer is present (installed here when
# missing); elsewhere it is skipped with its reason.
fuzz-build:
	@$(MAKE) --no-print-directory deps DEB_PACKAGES="$(FUZZ_PACKAGES)"
	cmake --preset fuzz >/dev/null
	cmake --build --preset fuzz

test-fuzz: fuzz-build
	@tests/fuzz/run_fuzz.sh $(FUZZ_SECONDS)

fuzz-long: fuzz-build
	@tests/fuzz/run_fuzz.sh $(FUZZ_LONG_SECONDS)

soak: deps
	@cmake --preset default >/dev/null
	cmake --build --preset default --target fabric_soak
	for p in $(SOAK_PROVIDERS); do
	  ./build/bin/fabric_soak --provider $$p --transfers $(SOAK_TRANSFERS) --seconds $(SOAK_SECONDS)
	done

bench-deps:
	@$(MAKE) --no-print-directory deps DEB_PACKAGES="$(BENCH_PACKAGES)"

bench: deps bench-deps
	@cmake --preset default >/dev/null
	cmake --build --preset default --target fabric-bench fabric-bench-raw
	mkdir -p bench/results
	# sys/op counts system calls through the raw_syscalls tracepoint, which needs tracefs.
	mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || \
	  echo "note: tracefs not mounted (not root?): the sys/op column reads n/a"
	# The writes (--op all) and the reads; an --op in BENCH_ARGS names the rows instead.
	ops="--op all,read,paged-read"
	case " $(BENCH_ARGS) " in *" --op"*) ops="";; esac
	for p in $(BENCH_PROVIDERS); do
	  echo
	  echo "== fabric-bench over libfabric $$p =="
	  ./build/bin/fabric-bench --provider $$p $$ops $(BENCH_ARGS) --json bench/results/$$p.json \
	    --markdown bench/results/$$p.md --plot bench/results/$$p.png
	done

PEERS_OUT ?= build/bench-peers
PEERS_ARGS ?=
bench-peers: deps bench-deps
	@cmake --preset default >/dev/null
	cmake --build --preset default --target fabric-bench fabric-bench-raw
	bench/peers/run.sh $(PEERS_OUT) $(PEERS_ARGS)

# NETLAB_RATE_MBIT: each link's shaped rate (the unequal runs halve one link).
NETLAB_RATE_MBIT ?= 400
bench-netlab: deps
	@cmake --preset default >/dev/null
	cmake --build --preset default --target fabric-bench
	bench/netlab_bench.sh $(NETLAB_RATE_MBIT) bench/results

# KV_DEMO_ARGS: e.g. --provider shm --requests 48 --compute-ms 5 (fabric-kv-demo --help).
KV_DEMO_ARGS ?=
demo-kv: deps
	@cmake --preset default >/dev/null
	cmake --build --preset default --target fabric-kv-demo
	./build/bin/fabric-kv-demo $(KV_DEMO_ARGS)

format:
	@clang-format -i $(SOURCES)

check-format:
	@if ! clang-format --dry-run --Werror $(SOURCES) 2>/dev/null; then
	  echo "clang-format would change these files (run: make format):"
	  clang-format --dry-run $(SOURCES) 2>&1 | grep -o '^[^:]*' | sort -u
	  exit 1
	fi

clean:
	@rm -rf build build-asan build-tsan build-fuzz

E2E_ARGS ?=
e2e-vllm: deps
	@bash tests/e2e/vllm/run.sh $(E2E_ARGS)
