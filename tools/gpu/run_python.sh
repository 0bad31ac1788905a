#!/bin/bash
# On the GPU machine, from the repository root, after tools/gpu/bundle.sh ran on the build machine.
# GPU machine: build the Python module against its python3 (3.12, PyTorch with CUDA), run the
# pytest suite with CUDA tensors (or only TESTS="tests/python/test_x.py ...");
# also what Ubuntu's libfabric says about FI_HMEM.
export LD_LIBRARY_PATH=$PWD/.gpu/lib:$LD_LIBRARY_PATH
export PYTHONUNBUFFERED=1
which c++ g++ python3; python3 --version; c++ --version | head -1
INC=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])"); ls $INC/Python.h
echo "== FI_HMEM as this machine's libfabric reports it (shm, tcp) =="
timeout -k 10 20 .gpu/bin/fi_info -p shm -c FI_HMEM -v 2>&1 | grep -iE "hmem|iface|mr_mode|caps" | head -12
timeout -k 10 20 .gpu/bin/fi_info -p tcp -c FI_HMEM 2>&1 | grep -E "provider|domain" | head -4
echo "== build the module =="
bash tools/gpu/build_module.sh /tmp/pkg . || exit 1
PYTHONPATH=/tmp/pkg python3 -c "import fabric_lib, torch; print('HAS_CUDA', fabric_lib.HAS_CUDA, 'torch', torch.__version__, torch.cuda.is_available())"
echo "== pytest =="
PYTHONPATH=/tmp/pkg timeout -k 10 420 python3 -m pytest -v -rs -p no:cacheprovider ${TESTS:-tests/python} > /tmp/pytest.log 2>&1; grep -E "test_cuda|test_register_cuda" /tmp/pytest.log; grep -E "FAILED|^E " /tmp/pytest.log | head -30; tail -5 /tmp/pytest.log
